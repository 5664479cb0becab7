"""Each step: gather the sizes of the global batch, plan a balanced assignment (the same plan on
every rank), and move the samples with all-to-all."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from loong_parallel.balance.assign import CapInfeasible, balance_assignment, imbalance, keep_local, rank_loads
from loong_parallel.balance.cost import SampleCost
from loong_parallel.balance.exchange import FieldSpec, Sample, exchange_samples
from loong_parallel.log import logger


@dataclass(frozen=True)
class BalancePlan:
    assignment: np.ndarray  # rank of every sample of the global batch
    naive_loads: np.ndarray  # per-rank cost where the samples already are
    loads: np.ndarray  # per-rank cost after the plan
    skipped: str | None  # why the samples stay where they are: "small" imbalance or "cap"

    @property
    def naive_imbalance(self) -> float:
        return imbalance(self.naive_loads)

    @property
    def imbalance(self) -> float:
        return imbalance(self.loads)


def plan_balance(sizes: np.ndarray, origin: np.ndarray, num_ranks: int, cost: SampleCost, *,
                 min_imbalance: float = 0.05, max_tokens: int | None = None) -> BalancePlan:
    """Pure planning: ``sizes`` [n] or [n, k] (column 0 = tokens) of the global batch, ``origin``
    the rank each sample is on. Keeps the samples in place when the imbalance is already at most
    ``min_imbalance``, when the plan would not lower it, or when the cap cannot be met."""
    sizes = np.asarray(sizes, dtype=np.float64)
    tokens = sizes[:, 0] if sizes.ndim == 2 else sizes
    costs = np.asarray(cost(sizes), dtype=np.float64)
    origin = np.asarray(origin, dtype=np.int64)
    naive = rank_loads(costs, origin, num_ranks)
    if imbalance(naive) <= min_imbalance:
        return BalancePlan(origin, naive, naive, "small")
    try:
        assignment = balance_assignment(costs, tokens, num_ranks, max_tokens=max_tokens)
    except CapInfeasible as e:
        logger.warning("DP balancing skipped this step: %s", e)
        return BalancePlan(origin, naive, naive, "cap")
    assignment = keep_local(assignment, origin, tokens, num_ranks)
    loads = rank_loads(costs, assignment, num_ranks)
    if loads.max() >= naive.max():
        return BalancePlan(origin, naive, naive, "small")
    return BalancePlan(assignment, naive, loads, None)


class DPBalancer:
    """Rebalances the samples of each global batch across the data-parallel ``group``.

    ``cost`` maps sample sizes to costs (:class:`~loong_parallel.balance.cost.QuadraticCost`, an
    :class:`~loong_parallel.balance.refit.OnlineCostFit`, or any callable, e.g. text tokens plus
    image patches for a VLM). Collectives run on ``device`` (the accelerator for NCCL).
    """

    def __init__(self, cost: SampleCost, *, group: dist.ProcessGroup | None = None,
                 device: torch.device | str = "cpu", min_imbalance: float = 0.05,
                 max_tokens: int | None = None) -> None:
        self.cost, self.group, self.device = cost, group, device
        self.min_imbalance, self.max_tokens = min_imbalance, max_tokens

    def _gather_sizes(self, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """All ranks' sizes in rank order, the origin rank of each, and this rank's offset."""
        world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        arr = np.asarray(sizes, dtype=np.float64)
        local = torch.from_numpy(arr[:, None] if arr.ndim == 1 else arr).to(self.device)
        count = torch.tensor([local.shape[0]], dtype=torch.int64, device=self.device)
        counts = [torch.empty_like(count) for _ in range(world)]
        dist.all_gather(counts, count, group=self.group)
        counts_list = [int(c) for c in torch.cat(counts).tolist()]
        padded = torch.zeros(max(counts_list), local.shape[1], dtype=torch.float64, device=self.device)
        padded[: local.shape[0]] = local
        gathered = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(gathered, padded, group=self.group)
        all_sizes = torch.cat([g[:n] for g, n in zip(gathered, counts_list)]).cpu().numpy()
        origin = np.repeat(np.arange(world), counts_list)
        all_sizes = all_sizes[:, 0] if all_sizes.shape[1] == 1 else all_sizes
        return all_sizes, origin, sum(counts_list[:rank])

    def balance(self, samples: Sequence[Sample], sizes: np.ndarray,
                spec: dict[str, FieldSpec]) -> tuple[list[tuple[int, dict[str, torch.Tensor]]], BalancePlan]:
        """Collective: this rank's samples (and their sizes, column 0 = tokens) in, the samples it
        trains on out, as ``(global id, sample)`` sorted by id. Global ids number the global batch
        in rank order; every id ends up on exactly one rank."""
        if len(samples) != len(sizes):
            raise ValueError(f"{len(samples)} samples but {len(sizes)} sizes")
        world = dist.get_world_size(self.group)
        all_sizes, origin, offset = self._gather_sizes(np.asarray(sizes))
        plan = plan_balance(all_sizes, origin, world, self.cost, min_imbalance=self.min_imbalance,
                            max_tokens=self.max_tokens)
        ids = list(range(offset, offset + len(samples)))
        if plan.skipped is not None:
            return [(i, dict(s)) for i, s in zip(ids, samples)], plan
        destinations = [int(plan.assignment[i]) for i in ids]
        return exchange_samples(samples, ids, destinations, spec, group=self.group, device=self.device), plan
