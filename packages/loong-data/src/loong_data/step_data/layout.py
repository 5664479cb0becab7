"""What every data kind needs to know about the run to cut its steps: batch shape and DP place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class StepLayout:
    micro_batch_size: int
    global_batch_size: int
    num_microbatches: int  # per step and DP rank (fixed-length data; packed data decides its own)
    eval_iters: int  # held-out micro-batches per DP rank and evaluation
    dp_rank: int = 0
    dp_size: int = 1
    seed: int = 0
    dp_group: Any = None  # for the collectives of some data kinds (counts, rebalancing)
    device: torch.device | None = None  # where those collectives run


@dataclass(frozen=True)
class StepCounts:
    """What one step consumed, summed over the data-parallel group: the tokens the throughput and
    FLOPs count, and the media (None: the data kind has none)."""

    tokens: int
    images: int | None = None
    patches: int = 0
    samples: int | None = None  # conversations (data kinds that count them)


class DataError(ValueError):
    """Data that cannot be used as configured; the message names the key or the file."""
