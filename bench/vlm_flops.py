"""What a VLM bench step computed, counted from its packed micro-batches, and its FLOPs by
loong-models' count (``loong_models.flops``, the one behind the train app's MFU): 6 N per LLM
token + causal attention over each sample's real tokens, and the vision tower on what it computes
(6 N per patch, the projector per merged token, bidirectional attention over the frame in
full-attention layers and the window in window layers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loong_models import ModelConfig

PEAK_BF16 = 989e12  # H100 / H200 dense bf16, DESIGN.md


@dataclass(frozen=True)
class StepCounts:
    """What one optimizer step processed (summed over its micro-batches)."""

    tokens: int  # real LLM tokens (padding excluded), image tokens included
    token_pairs: int  # sum over the samples of length**2 (their attention work)
    images: int
    patches: int  # ViT tokens
    flops: float
    vision_flops: float  # the vision tower's part of ``flops``


def step_counts(microbatches: list[dict], model: ModelConfig, pad_id: int) -> StepCounts:
    lengths, grids, images = [], [], 0
    for mb in microbatches:
        segments = torch.diff(mb["cu_seqlens"]).tolist()
        padded = int(mb["tokens"].shape[1]) > real_tokens(mb, pad_id)
        lengths += segments[: len(segments) - padded]  # no pad tail
        for key in ("image_grid_thw", "video_grid_thw"):
            if mb.get(key) is not None:
                grids += mb[key].tolist()
                images += len(mb[key]) if key == "image_grid_thw" else 0
    work = model.work(lengths, grids)
    flops = model.training_flops(work)
    text = model.training_flops(model.work(lengths))
    return StepCounts(work.tokens, work.token_pairs, images, work.patches, flops, flops - text)


def real_tokens(mb: dict, pad_id: int) -> int:
    """Tokens of a packed micro-batch without its padding tail: collate_packed pads with one last
    segment of ``pad_id`` tokens whose loss mask is zero."""
    n = int(mb["tokens"].shape[1])
    cu = mb["cu_seqlens"]
    tail = mb["tokens"][0, int(cu[-2]) :]
    if len(cu) > 2 and bool((tail == pad_id).all()) and not bool(mb["loss_mask"][0, int(cu[-2]) :].any()):
        return int(cu[-2])
    return n


def flops_per_token(counts: list[dict]) -> float:
    """Training FLOPs per LLM token over steps of :func:`step_counts` (as dicts: ``flops``, ``tokens``)."""
    return sum(c["flops"] for c in counts) / sum(c["tokens"] for c in counts)


def text_only_ceiling(mix: list[dict], text: list[dict]) -> float:
    """The highest LLM-token throughput ratio (vision mix / text-only) reachable at equal MFU: a
    step's time is its FLOPs / (MFU x peak), so at equal MFU tokens/s go as 1 / FLOPs per token,
    and each image token of the mix also pays the ViT over its patches (merge**2 per token)."""
    return flops_per_token(text) / flops_per_token(mix)


def mfu(flops_per_step: float, step_time_s: float, peak: float = PEAK_BF16) -> float:
    return flops_per_step / step_time_s / peak
