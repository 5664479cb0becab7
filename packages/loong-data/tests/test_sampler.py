from itertools import islice

import pytest

from loong_data import DistributedBatchSampler


def _steps(num_steps: int, **kwargs: int) -> list[list[list[int]]]:
    return list(islice(iter(DistributedBatchSampler(**kwargs)), num_steps))


def _flat(batch: list[list[int]]) -> list[int]:
    return [i for micro in batch for i in micro]


NUM_SAMPLES, GLOBAL = 103, 12  # 8 steps per epoch, 7 samples skipped per epoch
STEPS = 30  # spans several epochs


def test_shapes() -> None:
    for batch in _steps(5, num_samples=NUM_SAMPLES, micro_batch_size=3, num_microbatches=2, dp_rank=1,
                        dp_size=2, seed=0):
        assert len(batch) == 2 and all(len(micro) == 3 for micro in batch)


@pytest.mark.parametrize(("dp_size", "mbs", "nmb"), [(2, 3, 2), (3, 2, 2), (4, 1, 3), (6, 2, 1)])
def test_union_over_ranks_is_the_dp1_global_batch(dp_size: int, mbs: int, nmb: int) -> None:
    assert mbs * nmb * dp_size == GLOBAL
    reference = _steps(STEPS, num_samples=NUM_SAMPLES, micro_batch_size=GLOBAL, num_microbatches=1, dp_rank=0,
                       dp_size=1, seed=5)
    ranks = [_steps(STEPS, num_samples=NUM_SAMPLES, micro_batch_size=mbs, num_microbatches=nmb, dp_rank=r,
                    dp_size=dp_size, seed=5) for r in range(dp_size)]
    for step in range(STEPS):
        # Same samples in the same order: rank r holds the r-th contiguous slice.
        assert [i for rank in ranks for i in _flat(rank[step])] == _flat(reference[step])


def test_deterministic_per_seed() -> None:
    kwargs = dict(num_samples=NUM_SAMPLES, micro_batch_size=4, num_microbatches=3, dp_rank=0, dp_size=1)
    assert _steps(STEPS, seed=1, **kwargs) == _steps(STEPS, seed=1, **kwargs)
    assert _steps(STEPS, seed=1, **kwargs) != _steps(STEPS, seed=2, **kwargs)


def test_start_step_resumes_identically() -> None:
    kwargs = dict(num_samples=NUM_SAMPLES, micro_batch_size=2, num_microbatches=3, dp_rank=1, dp_size=2, seed=9)
    full = _steps(STEPS, **kwargs)
    sampler = DistributedBatchSampler(**kwargs)
    for start in (0, 1, 7, 8, 13, 29):  # inside, at and across epoch boundaries
        assert _steps(STEPS - start, start_step=start, **kwargs) == full[start:]
        assert sampler.batch_at(start) == full[start]
    # Far ahead costs the same as near: no replay.
    assert len(DistributedBatchSampler(start_step=10**9, **kwargs).batch_at(10**9)) == 3


def test_epochs_cover_without_repeats_and_reshuffle() -> None:
    sampler = DistributedBatchSampler(NUM_SAMPLES, micro_batch_size=GLOBAL, num_microbatches=1, dp_rank=0,
                                      dp_size=1, seed=0)
    assert sampler.steps_per_epoch == NUM_SAMPLES // GLOBAL
    batches = _steps(3 * sampler.steps_per_epoch, num_samples=NUM_SAMPLES, micro_batch_size=GLOBAL,
                     num_microbatches=1, dp_rank=0, dp_size=1, seed=0)
    epochs = [[i for b in batches[e * 8 : (e + 1) * 8] for i in _flat(b)] for e in range(3)]
    for epoch in epochs:
        assert len(epoch) == len(set(epoch)) == 8 * GLOBAL  # no sample twice within an epoch
        assert set(epoch) <= set(range(NUM_SAMPLES))
    assert epochs[0] != epochs[1] != epochs[2]
    # The skipped tail differs between epochs, so every sample is eventually seen.
    assert set(epochs[0]) | set(epochs[1]) | set(epochs[2]) == set(range(NUM_SAMPLES))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(num_samples=10, micro_batch_size=4, num_microbatches=2, dp_rank=0, dp_size=2), "cannot fill"),
        (dict(num_samples=10, micro_batch_size=1, num_microbatches=1, dp_rank=2, dp_size=2), "dp_rank"),
        (dict(num_samples=10, micro_batch_size=0, num_microbatches=1, dp_rank=0, dp_size=1), "micro_batch_size"),
        (dict(num_samples=10, micro_batch_size=1, num_microbatches=1, dp_rank=0, dp_size=1, start_step=-1),
         "start_step"),
    ],
)
def test_invalid_arguments(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DistributedBatchSampler(seed=0, **kwargs)
