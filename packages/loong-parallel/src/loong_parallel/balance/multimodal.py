"""A VLM sample's cost: its LLM tokens (``a*L + b*L^2 + c``) plus its images' ViT patches.

The vision encoder runs every image (and every temporal slice of a video) as its own attention
segment. Dense layers and windowed attention (a fixed window of patches) cost the same per patch;
full-attention layers cost the square of the frame's patch count. So a sample's sizes are
``[tokens, patches, sum over frames of patches^2]`` (column 0 = tokens: the per-rank cap counts
them) and its cost is ``llm(tokens) + patch * patches + frame_sq * sum patches^2``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from loong_parallel.balance.assign import balance_assignment
from loong_parallel.balance.cost import QuadraticCost, nonnegative_fit, segment_features


def vision_sizes(grids: Iterable[tuple[int, int, int]]) -> tuple[int, int]:
    """``(patches, sum over frames of patches^2)`` of images / videos given as ``(t, h, w)`` patch
    grids (a frame = one temporal patch of ``h * w`` patches, the ViT's attention segment)."""
    patches = frame_sq = 0
    for t, h, w in grids:
        patches += t * h * w
        frame_sq += t * (h * w) ** 2
    return patches, frame_sq


@dataclass(frozen=True)
class MultimodalCost:
    """``llm(tokens) + patch * patches + frame_sq * sum frame_patches^2`` of sizes
    ``[n, 3]`` (tokens, patches, frame_sq); a 1-D size is text only."""

    llm: QuadraticCost
    patch: float
    frame_sq: float

    def __post_init__(self) -> None:
        if min(self.patch, self.frame_sq) < 0:
            raise ValueError(f"vision cost coefficients must be >= 0, got {self}")

    @classmethod
    def from_flops(cls, llm: QuadraticCost, *, vision_parameters: int, vision_layers: int,
                   full_attention_layers: int, vision_width: int, window_patches: int) -> MultimodalCost:
        """Training FLOPs (3x forward) of the ViT: ``6*N`` per patch for its weights (``N``:
        encoder + projector parameters); bidirectional attention takes ``4 * S^2 * width``
        forward FLOPs per segment of ``S`` patches, i.e. ``12 * window * width`` per patch in a
        window layer and ``12 * width`` per squared frame in a full-attention layer."""
        window_layers = vision_layers - full_attention_layers
        patch = 6.0 * vision_parameters + 12.0 * window_layers * vision_width * window_patches
        return cls(llm, patch, 12.0 * full_attention_layers * vision_width)

    def __call__(self, sizes: np.ndarray) -> np.ndarray:
        x = np.asarray(sizes, dtype=np.float64)
        if x.ndim == 1:
            return self.llm(x)
        return self.llm(x[:, 0]) + self.patch * x[:, 1] + self.frame_sq * x[:, 2]

    # --- the cost family OnlineCostFit refits ---
    @staticmethod
    def features(work: tuple[np.ndarray, int, int]) -> np.ndarray:
        """``(segment_lengths, patches, frame_sq)`` a rank computed in a step ->
        ``[sum L, sum L^2, segments, patches, frame_sq]``."""
        segment_lengths, patches, frame_sq = work
        return np.concatenate([segment_features(segment_lengths), [float(patches), float(frame_sq)]])

    @staticmethod
    def fit(features: np.ndarray, seconds: np.ndarray) -> MultimodalCost | None:
        coef = nonnegative_fit(features, seconds)
        if coef is None or coef[0] + coef[1] <= 0:
            return None
        return MultimodalCost.from_coefficients(tuple(float(c) for c in coef))

    @staticmethod
    def from_coefficients(coef: tuple[float, ...]) -> MultimodalCost:
        a, b, c, patch, frame_sq = coef
        return MultimodalCost(QuadraticCost(a, b, c), patch, frame_sq)

    def coefficients(self) -> tuple[float, ...]:
        return (*self.llm.coefficients(), self.patch, self.frame_sq)

    def with_coefficients(self, coef: tuple[float, ...]) -> MultimodalCost:
        return self.from_coefficients(coef)

    def describe(self) -> str:
        a = self.llm.a or 1.0
        return (f"{self.llm.describe()}; + {self.patch / a:.3g} per ViT patch + {self.frame_sq / a:.3g} "
                "per squared frame (relative to the LLM's linear term)")


def split_media(grids: list[tuple[int, int, int]], num_ranks: int, cost: Callable) -> np.ndarray:
    """The TP rank that encodes each image / video (``(t, h, w)`` patch grids), balancing
    ``cost(sizes [n, 3])`` (tokens column unused: 0). Deterministic."""
    if not grids:
        return np.zeros(0, dtype=np.int64)
    sizes = np.array([[0, *vision_sizes([g])] for g in grids], dtype=np.float64)
    return balance_assignment(np.asarray(cost(sizes), dtype=np.float64), sizes[:, 1], num_ranks)
