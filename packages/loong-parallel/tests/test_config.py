import pytest

from loong_parallel import OptimConfig, ParallelConfig


def test_data_parallel_size_is_derived():
    assert ParallelConfig(tp=2, pp=2).data_parallel_size(8) == 2
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by parallel.tp \* parallel.pp = 4 \* 1"):
        ParallelConfig(tp=4).data_parallel_size(6)


@pytest.mark.parametrize(
    "pcfg, message",
    [
        (ParallelConfig(tp=0), r"parallel.tp=0 must be >= 1"),
        (ParallelConfig(tp=3), r"parallel.tp=3 must divide the attention heads \(32\) and KV groups \(8\)"),
        (ParallelConfig(pp=3), r"3 stages must divide the model's 16 layers"),
        (ParallelConfig(pp=2, vpp=3), r"parallel.pp=2 x parallel.vpp=3 = 6 stages"),
        (ParallelConfig(vpp=2), r"parallel.vpp=2 needs parallel.pp >= 2"),
        (ParallelConfig(sequence_parallel=True), r"sequence_parallel=true needs parallel.tp > 1"),
        (ParallelConfig(overlap_param_gather=True), r"needs parallel.distributed_optimizer=true"),
    ],
)
def test_layouts_that_cannot_hold_the_model_name_the_key(pcfg, message):
    with pytest.raises(ValueError, match=message):
        pcfg.validate(world_size=24, num_layers=16, num_heads=32, num_query_groups=8)


def test_valid_layout_passes():
    ParallelConfig(tp=2, pp=2, vpp=2, sequence_parallel=True).validate(8, 16, 32, 8)


@pytest.mark.parametrize(
    "ocfg, message",
    [(OptimConfig(schedule="step"), "allowed: cosine, linear, constant"), (OptimConfig(min_lr=1.0), "must be in")],
)
def test_bad_optimizer_settings(ocfg, message):
    with pytest.raises(ValueError, match=message):
        ocfg.validate()
