"""The balancer as a training run uses it: built from ``parallel.balance`` and the model's shape,
it rebalances each step's packed samples (a collective), learns from measured compute times and
reports what it did."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from loong_parallel.balance.balancer import BalancePlan, DPBalancer, plan_balance
from loong_parallel.balance.config import BalanceConfig
from loong_parallel.balance.cost import QuadraticCost
from loong_parallel.balance.exchange import FieldSpec
from loong_parallel.balance.multimodal import MultimodalCost, vision_sizes
from loong_parallel.balance.refit import OnlineCostFit

# What moves between ranks: a packed document sample (position ids are rebuilt after packing).
DOCUMENT_FIELDS = {"tokens": FieldSpec(torch.int64), "labels": FieldSpec(torch.int64),
                   "loss_mask": FieldSpec(torch.float32)}  # fmt: skip


def segment_lengths(microbatches: list[dict]) -> np.ndarray:
    """Every attention segment this rank computed (padding segments included: they cost too)."""
    return np.concatenate([np.diff(mb["cu_seqlens"].numpy()) for mb in microbatches])


@dataclass
class TrainBalancer:
    """The DP balancer plus what the loop reports and feeds back."""

    balancer: DPBalancer
    refit: OnlineCostFit | None = None
    fields: dict[str, FieldSpec] = field(default_factory=lambda: dict(DOCUMENT_FIELDS))
    last_plan: BalancePlan | None = field(default=None, init=False)

    def balance(self, samples: list[dict], lengths: np.ndarray) -> list[dict]:
        received, self.last_plan = self.balancer.balance(samples, lengths, self.fields)
        return [sample for _, sample in received]

    def observe(self, microbatches: list[dict], compute_s: float | None) -> None:
        """Collective (all ranks, every step) when refitting."""
        if self.refit is not None and compute_s is not None:
            self.refit.observe(segment_lengths(microbatches), compute_s)

    def metrics(self) -> dict[str, Any]:
        p = self.last_plan
        if p is None:
            return {}
        return {"dp_imbalance_naive": p.naive_imbalance, "dp_imbalance": p.imbalance,
                "dp_balance_skipped": p.skipped or ""}  # fmt: skip


@dataclass
class SelectBalancer:
    """The multimodal data path's balancer: every rank holds the whole global batch of a step, so
    each plans the same assignment of its samples (LLM tokens + ViT patches,
    :class:`MultimodalCost`) and keeps its share; nothing moves between ranks. Samples need
    ``len(sample)`` (tokens) and ``sample.grids`` (``(t, h, w)`` of each image / video)."""

    cost: MultimodalCost | OnlineCostFit
    group: Any
    min_imbalance: float
    max_tokens: int | None
    refit: OnlineCostFit | None = None
    last_plan: BalancePlan | None = field(default=None, init=False)

    def select(self, samples: list) -> list:
        """This rank's samples of the step's global batch (in stream order). Pure: no collective."""
        size, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        sizes = np.array([[len(s), *vision_sizes(s.grids)] for s in samples], dtype=np.float64).reshape(-1, 3)
        origin = np.repeat(np.arange(size), len(samples) // size)
        self.last_plan = plan_balance(sizes, origin, size, self.cost, min_imbalance=self.min_imbalance,
                                      max_tokens=self.max_tokens)  # fmt: skip
        return [s for s, r in zip(samples, self.last_plan.assignment) if r == rank]

    def observe(self, microbatches: list[dict], compute_s: float | None) -> None:
        """Collective (all ranks, every step) when refitting."""
        if self.refit is not None and compute_s is not None:
            grids = [tuple(g) for mb in microbatches for key in ("image_grid_thw", "video_grid_thw")
                     for g in (mb[key].tolist() if key in mb else [])]  # fmt: skip
            self.refit.observe((segment_lengths(microbatches), *vision_sizes(grids)), compute_s)

    def metrics(self) -> dict[str, Any]:
        p = self.last_plan
        if p is None:
            return {}
        out = {"dp_imbalance_naive": p.naive_imbalance, "dp_imbalance": p.imbalance,
               "dp_balance_skipped": p.skipped or ""}  # fmt: skip
        if self.refit is not None:
            out["dp_cost_refits"] = self.refit.refits
        return out


def build_balancer(cfg: BalanceConfig, *, num_parameters: int, num_layers: int, attention_width: int, group,
                   device: torch.device, **vision: int) -> TrainBalancer | SelectBalancer | None:  # fmt: skip
    """FLOP-based cost of the model, refitted online when ``cfg.refit``; None when balancing is off.
    ``vision`` (a VLM's vision tower, ``MultimodalCost.from_flops``' keywords): a
    :class:`SelectBalancer` whose cost counts the samples' ViT patches too."""
    if not cfg.enabled:
        return None
    cost = QuadraticCost.from_flops(num_parameters=num_parameters, num_layers=num_layers,
                                    attention_width=attention_width)  # fmt: skip
    if vision:
        cost = MultimodalCost.from_flops(cost, **vision)
    fit = None
    if cfg.refit:
        fit = OnlineCostFit(cost, warmup_steps=cfg.refit_warmup_steps, interval=cfg.refit_interval,
                            window=cfg.refit_window, device=device)  # fmt: skip
    if vision:
        return SelectBalancer(fit or cost, group, cfg.min_imbalance, cfg.max_tokens_per_rank, fit)
    dp = DPBalancer(fit or cost, group=group, device=device, min_imbalance=cfg.min_imbalance,
                    max_tokens=cfg.max_tokens_per_rank)  # fmt: skip
    return TrainBalancer(dp, fit)
