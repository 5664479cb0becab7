"""Seeded, resumable batch sampling for data-parallel training."""

from collections.abc import Iterator

import numpy as np


class DistributedBatchSampler:
    """Per-step sample indices for one data-parallel rank.

    Each step consumes a global batch of ``micro_batch_size * num_microbatches * dp_size``
    samples, read in order from a seeded permutation of ``range(num_samples)``; epoch ``e`` uses
    the permutation of seed ``seed + e``, and the tail of an epoch that does not fill a global
    batch is skipped (it is different each epoch, so no sample is left out for good). The global
    batch of a step therefore depends only on ``seed``, ``num_samples`` and the global batch
    size, not on ``dp_size``: DP=2 sees exactly the samples of DP=1, in the same order.

    Rank ``r`` takes the ``r``-th contiguous slice of the global batch and cuts it into
    ``num_microbatches`` lists of ``micro_batch_size`` indices. Iteration is infinite and starts
    at ``start_step``; any step is computed directly (:meth:`batch_at`), so resuming never replays.
    """

    def __init__(
        self,
        num_samples: int,
        *,
        micro_batch_size: int,
        num_microbatches: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        start_step: int = 0,
    ) -> None:
        for name, value in (("micro_batch_size", micro_batch_size), ("num_microbatches", num_microbatches),
                            ("dp_size", dp_size)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        self.num_samples = num_samples
        self.micro_batch_size = micro_batch_size
        self.num_microbatches = num_microbatches
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.start_step = start_step
        self.global_batch_size = micro_batch_size * num_microbatches * dp_size
        if num_samples < self.global_batch_size:
            raise ValueError(f"{num_samples} samples cannot fill one global batch of {self.global_batch_size} "
                             f"(micro_batch_size {micro_batch_size} x num_microbatches {num_microbatches} "
                             f"x dp_size {dp_size})")
        self.steps_per_epoch = num_samples // self.global_batch_size

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng(self.seed + epoch).permutation(self.num_samples)

    def _rank_batch(self, perm: np.ndarray, step: int) -> list[list[int]]:
        per_rank = self.micro_batch_size * self.num_microbatches
        start = (step % self.steps_per_epoch) * self.global_batch_size + self.dp_rank * per_rank
        mine = perm[start : start + per_rank].tolist()
        return [mine[i : i + self.micro_batch_size] for i in range(0, per_rank, self.micro_batch_size)]

    def batch_at(self, step: int) -> list[list[int]]:
        """This rank's microbatches of sample indices at ``step``."""
        return self._rank_batch(self._permutation(step // self.steps_per_epoch), step)

    def __iter__(self) -> Iterator[list[list[int]]]:
        step, epoch, perm = self.start_step, -1, np.empty(0, dtype=np.int64)
        while True:
            if step // self.steps_per_epoch != epoch:  # one permutation per epoch, not per step
                epoch = step // self.steps_per_epoch
                perm = self._permutation(epoch)
            yield self._rank_batch(perm, step)
            step += 1
