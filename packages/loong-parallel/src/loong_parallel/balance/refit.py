"""Refit the quadratic cost online from measured per-rank compute times."""

from __future__ import annotations

from collections import deque

import numpy as np
import torch
import torch.distributed as dist

from loong_parallel.balance.cost import QuadraticCost, fit_quadratic_cost, segment_features
from loong_parallel.log import logger


class OnlineCostFit:
    """A :class:`QuadraticCost` that starts from ``initial`` (FLOP counts) and is refitted from
    measurements: each step every rank contributes ``(sum L, sum L^2, segments, compute seconds)``
    of what it computed (all-gathered over ``group``, the whole world by default, so every rank
    holds the same rows). After ``warmup_steps`` (allocator and kernel warm-up would skew the
    fit), every ``interval`` steps :func:`fit_quadratic_cost` runs on the last ``window`` steps
    and rank 0's result is broadcast: all ranks must use bit-identical costs, or they would
    compute different assignments.

    Callable like a cost (``self(sizes) -> costs``). Note: with refitting on, the assignment
    depends on measured times, so it is no longer reproducible run to run (the loss still is).
    """

    def __init__(self, initial: QuadraticCost, *, warmup_steps: int = 3, interval: int = 10, window: int = 50,
                 group: dist.ProcessGroup | None = None, device: torch.device | str = "cpu") -> None:
        if warmup_steps < 0 or interval < 1 or window < 1:
            raise ValueError("warmup_steps must be >= 0, interval and window >= 1")
        self.cost = initial
        self.warmup_steps, self.interval = warmup_steps, interval
        self.group, self.device = group, device
        self._rows: deque[np.ndarray] = deque(maxlen=window)
        self._steps = 0

    def __call__(self, sizes: np.ndarray) -> np.ndarray:
        return self.cost(sizes)

    def observe(self, segment_lengths: np.ndarray, compute_s: float) -> QuadraticCost | None:
        """Record this rank's step; collective over ``group`` after warm-up. Returns the new cost
        when it was refitted this step."""
        self._steps += 1
        if self._steps <= self.warmup_steps:
            return None
        row = torch.tensor([*segment_features(segment_lengths), compute_s], dtype=torch.float64, device=self.device)
        rows = [torch.empty_like(row) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(rows, row, group=self.group)
        self._rows.append(torch.stack(rows).cpu().numpy())
        if (self._steps - self.warmup_steps) % self.interval:
            return None
        data = np.concatenate(list(self._rows))
        fitted = fit_quadratic_cost(data[:, :3], data[:, 3])
        coef = torch.tensor([fitted.a, fitted.b, fitted.c] if fitted else [-1.0, -1.0, -1.0],
                            dtype=torch.float64, device=self.device)
        dist.broadcast(coef, src=dist.get_global_rank(self.group, 0) if self.group else 0, group=self.group)
        a, b, c = coef.tolist()
        if a < 0:
            logger.debug("cost refit: no usable fit from %d rows; keeping %s", len(data), self.cost)
            return None
        self.cost = QuadraticCost(a, b, c)
        s = self.cost.scaled()
        logger.info("cost refit from %d rank-steps: cost ~ L + %.3g L^2 + %.3g (relative to the linear term)",
                    len(data), s.b, s.c)
        return self.cost
