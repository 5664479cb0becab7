"""Per-feature statistics (LeRobot's ``stats.json``: min, max, mean, std, count, q01, q99) and
the normalisation they define."""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum

import numpy as np


class NormMode(StrEnum):
    """How a feature is mapped to roughly [-1, 1] (see :class:`Normalizer`)."""

    mean_std = "mean_std"
    min_max = "min_max"
    quantiles = "quantiles"


MODES = tuple(NormMode)


def feature_stats(values: np.ndarray) -> dict[str, np.ndarray]:
    """Stats of ``values`` [N, ...] over the first axis (images: [N, H, W, C] -> per channel, kept
    as [C, 1, 1] as LeRobot stores them)."""
    x = values.astype(np.float64)
    if x.ndim == 4:  # images, HWC: per channel, in [0, 1]
        x = x.reshape(-1, x.shape[-1]) / 255.0
        reshape = (-1, 1, 1)
    else:
        reshape = None
    out = {"min": x.min(0), "max": x.max(0), "mean": x.mean(0), "std": x.std(0),
           "q01": np.quantile(x, 0.01, axis=0), "q99": np.quantile(x, 0.99, axis=0)}  # fmt: skip
    if reshape:
        out = {k: v.reshape(reshape) for k, v in out.items()}
    out["count"] = np.array([len(values)])
    return out


def aggregate_stats(
    per_episode: Sequence[dict[str, dict[str, np.ndarray]]],
) -> dict[str, dict[str, np.ndarray]]:
    """Combine per-episode stats (v2.1's ``episodes_stats.jsonl``): exact min / max / mean / std;
    quantiles, when present, as the count-weighted mean of the episodes' (an approximation)."""
    out = {}
    for key in per_episode[0]:
        parts = [ep[key] for ep in per_episode]
        n = np.array([p["count"].reshape(-1)[0] for p in parts], dtype=np.float64)
        w = n / n.sum()
        mean = sum(wi * p["mean"] for wi, p in zip(w, parts))
        var = sum(wi * (p["std"] ** 2 + (p["mean"] - mean) ** 2) for wi, p in zip(w, parts))
        agg = {"min": np.min([p["min"] for p in parts], 0), "max": np.max([p["max"] for p in parts], 0),
               "mean": mean, "std": np.sqrt(var), "count": np.array([int(n.sum())])}  # fmt: skip
        for q in ("q01", "q99"):
            if all(q in p for p in parts):
                agg[q] = sum(wi * p[q] for wi, p in zip(w, parts))
        out[key] = agg
    return out


class Normalizer:
    """Maps a feature to roughly [-1, 1] and back: ``mean_std`` (z-score), ``min_max`` or
    ``quantiles`` (q01..q99 -> -1..1, Pi0.5's choice for states and actions)."""

    def __init__(
        self, stats: dict[str, np.ndarray], mode: str, key: str = "feature", eps: float = 1e-8
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"normalisation mode {mode!r} for {key}; allowed: {', '.join(MODES)}")
        need = {"mean_std": ("mean", "std"), "min_max": ("min", "max"), "quantiles": ("q01", "q99")}[mode]
        missing = [s for s in need if s not in stats]
        if missing:
            raise KeyError(f"stats of {key} have no {missing[0]!r} (needed for mode {mode})")
        a, b = (np.asarray(stats[s], dtype=np.float32) for s in need)
        if mode == "mean_std":
            self.shift, self.scale = a, b + eps
        else:  # map [a, b] onto [-1, 1]
            self.shift, self.scale = (a + b) / 2, (b - a) / 2 + eps

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return ((x - self.shift) / self.scale).astype(np.float32)

    def inverse(self, x: np.ndarray) -> np.ndarray:
        return (x * self.scale + self.shift).astype(np.float32)
