"""The balancer as a training run uses it: built from ``parallel.balance`` and the model's shape,
it rebalances each step's packed samples (a collective), learns from measured compute times and
reports what it did."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from loong_parallel.balance.balancer import BalancePlan, DPBalancer
from loong_parallel.balance.config import BalanceConfig
from loong_parallel.balance.cost import QuadraticCost
from loong_parallel.balance.exchange import FieldSpec
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


def build_balancer(cfg: BalanceConfig, *, num_parameters: int, num_layers: int, attention_width: int, group,
                   device: torch.device) -> TrainBalancer | None:  # fmt: skip
    """FLOP-based cost of the model, refitted online when ``cfg.refit``; None when balancing is off."""
    if not cfg.enabled:
        return None
    cost = QuadraticCost.from_flops(num_parameters=num_parameters, num_layers=num_layers,
                                    attention_width=attention_width)  # fmt: skip
    fit = None
    if cfg.refit:
        fit = OnlineCostFit(cost, warmup_steps=cfg.refit_warmup_steps, interval=cfg.refit_interval,
                            window=cfg.refit_window, device=device)  # fmt: skip
    dp = DPBalancer(fit or cost, group=group, device=device, min_imbalance=cfg.min_imbalance,
                    max_tokens=cfg.max_tokens_per_rank)  # fmt: skip
    return TrainBalancer(dp, fit)
