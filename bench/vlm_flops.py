"""FLOP accounting of a Qwen2.5-VL-style VLM step, for bench/vlm_throughput.py (and its tests).

The language model follows DESIGN.md: (6 N + 6 L h s) per LLM token, N the LLM's parameters
(embedding included, as in the LLM benchmark), s the sequence length, for every real (non-padding)
token of the step; image tokens are LLM tokens too.

The vision tower is counted on what it actually computes, per 14x14 patch (a ViT token):
  6 N_blocks per patch (patch embedding + transformer blocks, forward + backward),
  6 N_merger per merged token (the patch merger runs on patches / merge**2 tokens),
  attention 12 h_v * span per patch and layer: bidirectional, so twice the causal 6 L h s term,
  span = all patches of the image in full-attention layers, the window's patches (at most the
  image's) in windowed layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PEAK_BF16 = 989e12  # H100 / H200 dense bf16, DESIGN.md


@dataclass(frozen=True)
class VisionShape:
    depth: int
    hidden: int
    ffn: int
    out_hidden: int
    patch: int = 14
    temporal_patch: int = 2
    merge: int = 2
    window_size: int = 112  # pixels; windowed layers attend within window_size x window_size
    fullatt_blocks: tuple[int, ...] = (7, 15, 23, 31)
    in_channels: int = 3

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch * self.patch * self.patch

    def block_params(self) -> int:
        """Patch embedding (no bias) + blocks (two RMSNorms, qkv with bias, proj, gated MLP with bias)."""
        h, f = self.hidden, self.ffn
        block = 2 * h + (3 * h * h + 3 * h) + (h * h + h) + (2 * h * f + 2 * f) + (f * h + h)
        return self.patch_dim * h + self.depth * block

    def merger_params(self) -> int:
        """RMSNorm, then Linear(h m^2, h m^2) + GELU + Linear(h m^2, out), with biases."""
        wide = self.hidden * self.merge**2
        return self.hidden + wide * wide + wide + wide * self.out_hidden + self.out_hidden

    def window_patches(self) -> int:
        side = self.window_size // self.patch  # patches along a window side
        return side * side

    def num_full(self) -> int:
        return sum(1 for i in self.fullatt_blocks if 0 <= i < self.depth)


def vision_flops(shape: VisionShape, image_grid_thw: torch.Tensor) -> float:
    """Training FLOPs (forward + backward) of the vision tower and merger on these images."""
    flops = 0.0
    n_full = shape.num_full()
    n_win = shape.depth - n_full
    for t, h, w in image_grid_thw.tolist():
        patches = t * h * w
        per_frame = h * w
        flops += 6 * shape.block_params() * patches
        flops += 6 * shape.merger_params() * patches / shape.merge**2
        # attention spans: whole frame (Qwen2.5-VL's full layers attend within each frame's
        # cu_seqlens), or the window (clipped to the frame)
        span_full = per_frame
        span_win = min(shape.window_patches(), per_frame)
        flops += 12 * shape.hidden * patches * (n_full * span_full + n_win * span_win)
    return flops


def llm_flops(num_parameters: int, num_layers: int, hidden: int, seq_length: int, tokens: int) -> float:
    """DESIGN.md: (6 N + 6 L h s) per token."""
    return (6 * num_parameters + 6 * num_layers * hidden * seq_length) * tokens


def llm_flops_packed(num_parameters: int, num_layers: int, hidden: int, tokens: int, token_pairs: int) -> float:
    """DESIGN.md's formula with ``s`` the real length of each token's own sample rather than the
    pack length: 6 N per token + 6 L h per (token, token of its sample) pair, ``token_pairs`` =
    sum of squared sample lengths. A pack of short samples costs what its samples cost."""
    return 6 * num_parameters * tokens + 6 * num_layers * hidden * token_pairs


@dataclass(frozen=True)
class StepCounts:
    """What one optimizer step processed (summed over its micro-batches)."""

    tokens: int  # real LLM tokens (padding excluded), image tokens included
    token_pairs: int  # sum over the samples of length**2 (their attention work)
    images: int
    patches: int  # ViT tokens
    vision_flops: float


def step_counts(microbatches: list[dict], vision: VisionShape, pad_id: int) -> StepCounts:
    tokens = pairs = images = patches = 0
    vflops = 0.0
    for mb in microbatches:
        real = real_tokens(mb, pad_id)
        tokens += real
        lengths = torch.diff(mb["cu_seqlens"]).tolist()
        pairs += sum(n * n for n in lengths[: len(lengths) - (int(mb["tokens"].shape[1]) > real)])  # no pad tail
        grid = mb.get("image_grid_thw")
        if grid is not None and len(grid):
            images += int(grid.shape[0])
            patches += int(grid.prod(dim=1).sum())
            vflops += vision_flops(vision, grid)
    return StepCounts(tokens, pairs, images, patches, vflops)


def real_tokens(mb: dict, pad_id: int) -> int:
    """Tokens of a packed micro-batch without its padding tail: collate_packed pads with one last
    segment of ``pad_id`` tokens whose loss mask is zero."""
    n = int(mb["tokens"].shape[1])
    cu = mb["cu_seqlens"]
    tail = mb["tokens"][0, int(cu[-2]) :]
    if len(cu) > 2 and bool((tail == pad_id).all()) and not bool(mb["loss_mask"][0, int(cu[-2]) :].any()):
        return int(cu[-2])
    return n


def mfu(flops_per_step: float, step_time_s: float, peak: float = PEAK_BF16) -> float:
    return flops_per_step / step_time_s / peak
