"""Seeded length distributions for cutting documents into variable-length samples."""

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LogNormalLengths:
    """Lengths ``round(median * exp(sigma * N(0, 1)))`` clipped to ``[min_length, max_length]``;
    a ``long_fraction`` of the draws is ``max_length`` itself. That gives the long tail of mixed
    data (mostly short text, a few very long documents or media samples) on any corpus."""

    median: float
    sigma: float
    min_length: int = 1
    long_fraction: float = 0.0

    def __post_init__(self) -> None:
        if self.median < 1 or self.sigma < 0 or self.min_length < 1 or not 0 <= self.long_fraction <= 1:
            raise ValueError(f"invalid LogNormalLengths {self}: need median >= 1, sigma >= 0, min_length >= 1, "
                             "0 <= long_fraction <= 1")

    def sample(self, rng: np.random.Generator, n: int, max_length: int) -> np.ndarray:
        lengths = np.rint(self.median * np.exp(self.sigma * rng.standard_normal(n)))
        lengths = np.clip(lengths, min(self.min_length, max_length), max_length).astype(np.int64)
        lengths[rng.random(n) < self.long_fraction] = max_length
        return lengths
