"""The packed (THD) data path of the train app: document samples of a step, optionally moved
between DP ranks by the load balancer, packed into ``data.seq_length``-token micro-batches."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from loong_data import DocumentDataset, PackingStrategy, collate_packed, padded_length
from loong_parallel.balance import BalancePlan, DPBalancer, FieldSpec, OnlineCostFit, QuadraticCost

# What moves between ranks; position ids are rebuilt by collate_packed.
EXCHANGED = {"tokens": FieldSpec(torch.int64), "labels": FieldSpec(torch.int64), "loss_mask": FieldSpec(torch.float32)}


@dataclass
class PackedDocuments:
    """A document dataset and how its samples are packed (what ``step_batches`` consumes)."""

    documents: DocumentDataset
    capacity: int
    strategy: PackingStrategy
    pad_id: int
    # Every document is padded to a multiple of this (context parallelism: 2 x cp chunks each).
    segment_multiple: int = 1

    def __len__(self) -> int:
        return len(self.documents)

    def step(self, indices: list[int], balancer: TrainBalancer | None) -> list[dict[str, Any]]:
        samples = [{k: v for k, v in self.documents[i].items() if k in EXCHANGED} for i in indices]
        if balancer is not None:
            samples = balancer.balance(samples, self.documents.lengths[indices])
        lengths = [padded_length(int(s["tokens"].shape[0]), self.segment_multiple) for s in samples]
        packs = self.strategy.pack(lengths, self.capacity)
        return [collate_packed([samples[j] for j in pack], capacity=self.capacity, pad_id=self.pad_id,
                               segment_multiple=self.segment_multiple)
                for pack in packs]


def is_packed(microbatches: list[dict]) -> bool:
    return bool(microbatches) and "cu_seqlens" in microbatches[0]


def schedule_shape(microbatches: list[dict], default: dict[str, int]) -> dict[str, int]:
    """megatron schedule arguments: packed steps have their own micro-batch count, each a
    ``[1, capacity]`` sequence (the shape pipeline stages exchange)."""
    if not is_packed(microbatches):
        return default
    return dict(num_microbatches=len(microbatches), seq_length=int(microbatches[0]["tokens"].shape[1]),
                micro_batch_size=1)


def segment_lengths(microbatches: list[dict]) -> np.ndarray:
    """Every attention segment this rank computed (padding segments included: they cost too)."""
    return np.concatenate([np.diff(mb["cu_seqlens"].numpy()) for mb in microbatches])


@dataclass
class TrainBalancer:
    """The DP balancer plus what the loop reports and feeds back."""

    balancer: DPBalancer
    refit: OnlineCostFit | None = None
    last_plan: BalancePlan | None = field(default=None, init=False)

    def balance(self, samples: list[dict], lengths: np.ndarray) -> list[dict]:
        received, self.last_plan = self.balancer.balance(samples, lengths, EXCHANGED)
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
                "dp_balance_skipped": p.skipped or ""}


def build_balancer(*, num_parameters: int, num_layers: int, attention_width: int, group, device,
                   min_imbalance: float, max_tokens: int | None, refit: bool, warmup_steps: int,
                   interval: int, window: int) -> TrainBalancer:
    """FLOP-based cost of the model, refitted online when ``refit``."""
    cost = QuadraticCost.from_flops(num_parameters=num_parameters, num_layers=num_layers,
                                    attention_width=attention_width)
    fit = OnlineCostFit(cost, warmup_steps=warmup_steps, interval=interval, window=window, device=device) if refit else None
    dp = DPBalancer(fit or cost, group=group, device=device, min_imbalance=min_imbalance, max_tokens=max_tokens)
    return TrainBalancer(dp, fit)
