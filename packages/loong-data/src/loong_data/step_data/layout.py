"""What every data kind needs to know about the run to cut its steps: batch shape and DP place."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import torch

from loong_data.errors import DataError  # noqa: F401  (re-exported: the step-data modules import it from here)


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
    # Packed documents are padded to a multiple of this (context parallelism cuts each into 2 x cp chunks).
    segment_multiple: int = 1
    # A pack (packed multimodal data) is padded to a multiple of this many tokens, at most to the
    # sequence length; None: always to the sequence length (the static shape pipeline stages exchange).
    pack_multiple: int | None = None


@dataclass(frozen=True)
class StepCounts:
    """What one step consumed, summed over the data-parallel group: the tokens the throughput and
    FLOPs count, and the media (None: the data kind has none)."""

    tokens: int
    images: int | None = None
    patches: int = 0
    samples: int | None = None  # conversations (data kinds that count them)
    digest: int | None = None  # batch_digest of the step's micro-batches (summed over ranks, mod 2**32)
    # Sum over the samples of their real length**2 (their attention work); None: every token
    # attends within a row of data.seq_length (fixed rows).
    token_pairs: int | None = None
    grids: tuple[tuple[int, int, int], ...] = ()  # (t, h, w) patch grid of every image and video


def batch_digest(microbatches: list[dict]) -> int:
    """CRC-32 of the step's token ids and image / video grids: two stacks (or two runs) that
    report the same digest trained on the same samples (benchmarks assert it)."""
    crc = 0
    for mb in microbatches:
        for key in ("tokens", "image_grid_thw", "video_grid_thw"):
            if key in mb:
                crc = zlib.crc32(mb[key].to(torch.int64).numpy().tobytes(), crc)
    return crc
