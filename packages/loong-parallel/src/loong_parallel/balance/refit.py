"""Refit the quadratic cost online from measured per-rank compute times."""

from __future__ import annotations

from collections import deque

import numpy as np
import torch
import torch.distributed as dist

from loong_parallel.balance.cost import QuadraticCost
from loong_parallel.balance.multimodal import MultimodalCost
from loong_parallel.log import logger


class OnlineCostFit:
    """A cost that starts from ``initial`` (FLOP counts: a :class:`QuadraticCost`, or a
    :class:`MultimodalCost` for a VLM) and is refitted from measurements: each step every rank
    contributes the cost's features of what it computed (``(sum L, sum L^2, segments)``, plus the
    ViT's patches and squared frames for a VLM) and its compute seconds, all-gathered over
    ``group`` (the whole world by default, so every rank holds the same rows). After
    ``warmup_steps`` (allocator and kernel warm-up would skew the fit), every ``interval`` steps
    the cost's own ``fit`` (non-negative least squares) runs on the last ``window`` steps and rank
    0's result is broadcast: all ranks must use bit-identical costs, or they would compute
    different assignments. ``refits`` counts the fits that replaced the cost.

    Callable like a cost (``self(sizes) -> costs``). Note: with refitting on, the assignment
    depends on measured times, so it is no longer reproducible run to run (the loss still is).
    """

    def __init__(self, initial: QuadraticCost | MultimodalCost, *, warmup_steps: int = 3, interval: int = 10, window: int = 50,
                 group: dist.ProcessGroup | None = None, device: torch.device | str = "cpu") -> None:
        if warmup_steps < 0 or interval < 1 or window < 1:
            raise ValueError("warmup_steps must be >= 0, interval and window >= 1")
        self.cost = initial
        self.warmup_steps, self.interval = warmup_steps, interval
        self.group, self.device = group, device
        self._rows: deque[np.ndarray] = deque(maxlen=window)
        self._steps = 0
        self.refits = 0

    def __call__(self, sizes: np.ndarray) -> np.ndarray:
        return self.cost(sizes)

    def observe(self, work, compute_s: float) -> QuadraticCost | MultimodalCost | None:
        """Record this rank's step (``work``: what the cost's ``features`` take, the segment
        lengths for text); collective over ``group`` after warm-up. Returns the new cost when it
        was refitted this step."""
        self._steps += 1
        if self._steps <= self.warmup_steps:
            return None
        row = torch.tensor([*self.cost.features(work), compute_s], dtype=torch.float64, device=self.device)
        rows = [torch.empty_like(row) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(rows, row, group=self.group)
        self._rows.append(torch.stack(rows).cpu().numpy())
        if (self._steps - self.warmup_steps) % self.interval:
            return None
        data = np.concatenate(list(self._rows))
        fitted = self.cost.fit(data[:, :-1], data[:, -1])
        width = len(self.cost.coefficients())
        coef = torch.tensor(fitted.coefficients() if fitted else [-1.0] * width, dtype=torch.float64,
                            device=self.device)
        dist.broadcast(coef, src=dist.get_global_rank(self.group, 0) if self.group else 0, group=self.group)
        values = tuple(coef.tolist())
        if values[0] < 0:
            logger.debug("cost refit: no usable fit from %d rows; keeping %s", len(data), self.cost)
            return None
        self.cost = self.cost.with_coefficients(values)
        self.refits += 1
        logger.info("cost refit from %d rank-steps: %s", len(data), self.cost.describe())
        return self.cost
