"""DP load balancing of multimodal steps (``data.kind=multimodal data.balance.enabled=true``).

Every rank reads the whole global batch of a step (multimodal.py), so balancing needs no
exchange: each rank plans the same assignment of the step's samples to the DP ranks from their
costs (LLM tokens + ViT patches, loong_parallel.balance.MultimodalCost, refitted online from the
measured compute times) and keeps its share. With megatron's per-token loss the loss and the
gradients do not depend on the assignment, only the summation order does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loong_data.multimodal import MultimodalSample
from loong_models import ModelConfig
from loong_models.image_encoder.config import get_encoder_type
from loong_parallel.balance import (
    BalancePlan,
    MultimodalCost,
    OnlineCostFit,
    QuadraticCost,
    plan_balance,
    vision_sizes,
)
from loong_train.thd import segment_lengths


def sample_sizes(samples: list[MultimodalSample]) -> np.ndarray:
    """``[n, 3]``: tokens, ViT patches, sum of squared frame patches of each sample."""
    return np.array([[len(s), *vision_sizes(s.grids)] for s in samples], dtype=np.float64).reshape(-1, 3)


def step_work(microbatches: list[dict]) -> tuple[np.ndarray, int, int]:
    """What this rank computed in a step, as MultimodalCost.features takes it."""
    grids = [tuple(g) for mb in microbatches for key in ("image_grid_thw", "video_grid_thw")
             for g in mb.get(key, np.zeros((0, 3))).tolist()]  # fmt: skip
    return (segment_lengths(microbatches), *vision_sizes(grids))


def flop_cost(model: ModelConfig) -> MultimodalCost:
    """The FLOP-based cost of the model's LLM (active parameters) and vision tower."""
    f, e = model.foundation, model.image_encoder
    llm = QuadraticCost.from_flops(num_parameters=f.num_active_parameters(), num_layers=f.num_layers,
                                   attention_width=f.num_attention_heads * f.head_dim)  # fmt: skip
    vision = e.num_parameters() + model.image_projector.num_parameters(
        e.hidden_size, e.spatial_merge_size, f.hidden_size
    )
    windows = get_encoder_type(e.type).windows
    return MultimodalCost.from_flops(
        llm, vision_parameters=vision, vision_layers=e.num_layers,
        full_attention_layers=len(e.fullatt_block_indexes) if windows else e.num_layers,
        vision_width=e.num_attention_heads * e.head_dim,
        window_patches=(e.window_size // e.patch_size) ** 2 if windows else 0,
    )  # fmt: skip


@dataclass
class MultimodalBalancer:
    """Plans each step's assignment (the same on every rank) and refits the cost."""

    cost: MultimodalCost | OnlineCostFit
    dp_rank: int
    dp_size: int
    min_imbalance: float
    max_tokens: int | None
    refit: OnlineCostFit | None = None
    last_plan: BalancePlan | None = field(default=None, init=False)

    def select(self, samples: list[MultimodalSample]) -> list[MultimodalSample]:
        """This rank's samples of the step's global batch (in stream order)."""
        per_rank = len(samples) // self.dp_size
        origin = np.repeat(np.arange(self.dp_size), per_rank)
        self.last_plan = plan_balance(sample_sizes(samples), origin, self.dp_size, self.cost,
                                      min_imbalance=self.min_imbalance, max_tokens=self.max_tokens)  # fmt: skip
        return [s for s, rank in zip(samples, self.last_plan.assignment) if rank == self.dp_rank]

    def observe(self, microbatches: list[dict], compute_s: float | None) -> None:
        """Collective (all ranks, every step) when refitting."""
        if self.refit is not None and compute_s is not None:
            self.refit.observe(step_work(microbatches), compute_s)

    def metrics(self) -> dict[str, Any]:
        p = self.last_plan
        if p is None:
            return {}
        out = {"dp_imbalance_naive": p.naive_imbalance, "dp_imbalance": p.imbalance,
               "dp_balance_skipped": p.skipped or ""}  # fmt: skip
        if self.refit is not None:
            out["dp_cost_refits"] = self.refit.refits
        return out


def build_multimodal_balancer(model: ModelConfig, *, dp_rank: int, dp_size: int, group, device,
                              min_imbalance: float, max_tokens: int | None, refit: bool, warmup_steps: int,
                              interval: int, window: int) -> MultimodalBalancer:  # fmt: skip
    cost = flop_cost(model)
    fit = OnlineCostFit(cost, warmup_steps=warmup_steps, interval=interval, window=window, group=group,
                        device=device) if refit else None  # fmt: skip
    return MultimodalBalancer(fit or cost, dp_rank, dp_size, min_imbalance, max_tokens, fit)
