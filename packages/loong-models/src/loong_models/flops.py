"""Training FLOPs of a model (forward + backward): the one count behind the trainer's MFU and the
benchmarks (DESIGN.md).

Language model: ``6 N`` per token (N: the parameters a token uses, an MoE's active ones, the
embedding included) plus causal attention, ``6 L h`` per (token, token of its own sample) pair, so
a pack of short samples costs what its samples cost (fixed-length rows: ``6 L h s`` per token).

Vision tower, on what it computes per ViT patch: ``6 N_encoder`` per patch, ``6 N_projector`` per
merged token (patches / merge**2), and bidirectional attention, ``12 h_v`` per (patch, patch it
attends) pair and layer: every patch of its frame in full-attention layers, the patches of its
window in the window layers (Qwen2.5-VL's windows tile each frame from its top-left corner, edge
windows smaller). Every count here adds over samples, so sums over ranks and micro-batches are
exact.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from loong_models.image_encoder.config import ImageEncoderConfig, get_encoder_type

if TYPE_CHECKING:
    from loong_models.model import ModelConfig


@dataclass(frozen=True)
class Work:
    """What a step computed, in additive counts (see the module docstring)."""

    tokens: int = 0  # LLM tokens (padding excluded, image tokens included)
    token_pairs: int = 0  # sum over the samples of length**2
    patches: int = 0  # ViT patches
    full_pairs: int = 0  # sum over frames of patches**2 (one full-attention layer's pairs)
    window_pairs: int = 0  # sum over windows of patches**2 (one window layer's pairs)

    def __add__(self, other: Work) -> Work:
        return Work(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


def _chunks(n: int, size: int) -> list[int]:
    """``n`` cut into pieces of ``size`` from the start, the last one shorter."""
    return [size] * (n // size) + ([n % size] if n % size else [])


def vision_work(encoder: ImageEncoderConfig, grids: Iterable[Sequence[int]]) -> Work:
    """Patches and attention pairs of the images / videos of these ``(t, h, w)`` patch grids."""
    windows = get_encoder_type(encoder.type).windows
    m = encoder.spatial_merge_size
    side = encoder.window_size // (m * encoder.patch_size)  # window side in merge blocks
    patches = full = window = 0
    for t, h, w in grids:
        patches += t * h * w
        full += t * (h * w) ** 2
        if windows:
            rows, cols = _chunks(h // m, side), _chunks(w // m, side)
            window += t * m**4 * sum(r * r for r in rows) * sum(c * c for c in cols)
    return Work(patches=patches, full_pairs=full, window_pairs=window)


def work(model: ModelConfig, sample_lengths: Iterable[int], grids: Iterable[Sequence[int]] = ()) -> Work:
    """The counts of samples of these real token counts with images of these patch grids."""
    lengths = list(sample_lengths)
    text = Work(tokens=sum(lengths), token_pairs=sum(n * n for n in lengths))
    grids = list(grids)
    if model.image_encoder is None or not grids:
        return text
    return text + vision_work(model.image_encoder, grids)


def training_flops(model: ModelConfig, counts: Work) -> float:
    """Training FLOPs of ``counts`` on ``model``: its foundation LLM and a VLM's vision tower."""
    flops = model.foundation.training_flops(counts.tokens, counts.token_pairs)
    if model.image_encoder is None or not counts.patches:
        return flops
    return flops + _vision_flops(model, counts)


def _vision_flops(model: ModelConfig, counts: Work) -> float:
    e, merge = model.image_encoder, model.image_encoder.spatial_merge_size
    # the projector and Qwen3-VL's DeepStack mergers each run on the merged tokens
    projector = model.image_projector.num_parameters(e.hidden_size, merge, model.foundation.hidden_size,
                                                     len(e.deepstack_visual_indexes))  # fmt: skip
    full_layers = len(set(e.fullatt_block_indexes)) if get_encoder_type(e.type).windows else e.num_layers
    pairs = full_layers * counts.full_pairs + (e.num_layers - full_layers) * counts.window_pairs
    return (
        6 * e.num_parameters() * counts.patches
        + 6 * projector * counts.patches / merge**2
        + 12 * e.hidden_size * pairs
    )
