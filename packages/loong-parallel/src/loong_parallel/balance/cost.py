"""Per-sample compute cost ``a*L + b*L^2 + c`` and its fit to measured step times.

A sample's cost is what the balancer equalises across data-parallel ranks. The linear term is the
dense layers (every token passes every weight once), the quadratic term causal attention, the
constant a per-sample overhead (kernel launches of the per-document attention, ...).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import combinations

import numpy as np

# sizes [n, k] -> costs [n]. Column 0 is the sample's token count (the per-rank cap counts it);
# more columns carry other inputs, e.g. image patches, whose cost a VLM adds with its own terms.
SampleCost = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class QuadraticCost:
    """``cost(L) = a*L + b*L**2 + c`` of a sample of ``L`` tokens (column 0 of the sizes)."""

    a: float
    b: float
    c: float = 0.0

    def __post_init__(self) -> None:
        if min(self.a, self.b, self.c) < 0 or self.a + self.b == 0:
            raise ValueError(f"cost coefficients must be >= 0 with a + b > 0, got {self}")

    @classmethod
    def from_flops(cls, *, num_parameters: int, num_layers: int, attention_width: int) -> QuadraticCost:
        """Training FLOPs (forward + backward = 3x forward): ``6*N`` per token for the weights
        (``N`` parameters), and ``6 * layers * width * L`` per token for causal attention, whose
        QK^T and PV products each take ``L^2 * width`` multiply-adds over the causal half."""
        return cls(a=6.0 * num_parameters, b=6.0 * num_layers * attention_width, c=0.0)

    def __call__(self, sizes: np.ndarray) -> np.ndarray:
        tokens = np.asarray(sizes, dtype=np.float64)
        tokens = tokens[:, 0] if tokens.ndim == 2 else tokens
        return self.a * tokens + self.b * tokens * tokens + self.c

    # --- what OnlineCostFit refits through (a cost family: features, fit, coefficients) ---
    @staticmethod
    def features(segment_lengths: np.ndarray) -> np.ndarray:
        return segment_features(segment_lengths)

    @staticmethod
    def fit(features: np.ndarray, seconds: np.ndarray) -> QuadraticCost | None:
        return fit_quadratic_cost(features, seconds)

    def coefficients(self) -> tuple[float, ...]:
        return (self.a, self.b, self.c)

    def with_coefficients(self, coef: tuple[float, ...]) -> QuadraticCost:
        return QuadraticCost(*coef)

    def describe(self) -> str:
        s = self.scaled()
        return f"cost ~ L + {s.b:.3g} L^2 + {s.c:.3g} (relative to the linear term)"

    def scaled(self) -> QuadraticCost:
        """The same cost relative to its linear coefficient (easier to read in logs)."""
        return QuadraticCost(1.0, self.b / self.a, self.c / self.a) if self.a > 0 else self


def segment_features(segment_lengths: np.ndarray) -> np.ndarray:
    """``[sum L, sum L^2, count]`` of the segments one rank computed in a step."""
    lengths = np.asarray(segment_lengths, dtype=np.float64)
    return np.array([lengths.sum(), (lengths * lengths).sum(), float(len(lengths))])


def nonnegative_fit(features: np.ndarray, seconds: np.ndarray) -> np.ndarray | None:
    """Non-negative least squares of ``seconds ~ features @ coef + d`` (``d`` an intercept, fitted
    and dropped: what every rank pays per step whatever its samples, launch latency, the loss
    reduction; it does not move between ranks). With few unknowns exact NNLS is cheap: ordinary
    least squares on every subset of the columns (scaled to unit norm for conditioning), keeping
    the best fit whose coefficients are all >= 0. Returns ``coef`` (one per feature column), or
    None when no subset fits."""
    x = np.asarray(features, dtype=np.float64)
    y = np.asarray(seconds, dtype=np.float64)
    if x.ndim != 2 or len(x) != len(y):
        raise ValueError(f"features must be [n, k] with one time per row, got {x.shape} and {y.shape}")
    k = x.shape[1] + 1
    x = np.column_stack([x, np.ones(len(x))])
    norms = np.linalg.norm(x, axis=0)
    norms[norms == 0] = 1.0
    xs = x / norms
    best: tuple[float, np.ndarray] | None = None
    for size in range(k, 0, -1):
        for cols in combinations(range(k), size):
            sol, *_ = np.linalg.lstsq(xs[:, cols], y, rcond=None)
            if np.any(sol < 0):
                continue
            coef = np.zeros(k)
            coef[list(cols)] = sol
            residual = float(np.sum((xs @ coef - y) ** 2))
            if best is None or residual < best[0] * (1 - 1e-9):
                best = (residual, coef)
    return None if best is None else (best[1] / norms)[:-1]


def fit_quadratic_cost(features: np.ndarray, seconds: np.ndarray) -> QuadraticCost | None:
    """:func:`nonnegative_fit` of ``seconds ~ a*sum L + b*sum L^2 + c*count + d`` over rows of
    ``features`` (one row per rank and step, see :func:`segment_features`). Returns None when no
    subset gives a usable model (a + b > 0)."""
    x = np.asarray(features, dtype=np.float64)
    if x.ndim != 2 or x.shape[1] != 3:
        raise ValueError(f"features must be [n, 3] with one time per row, got {x.shape}")
    coef = nonnegative_fit(x, seconds)
    if coef is None or coef[0] + coef[1] <= 0:
        return None
    a, b, c = coef
    return QuadraticCost(float(a), float(b), float(c))
