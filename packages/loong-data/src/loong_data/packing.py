"""Packing strategies: which samples share one packed sequence of ``capacity`` tokens.

A strategy maps sample lengths to packs (lists of sample positions); every sample lands in
exactly one pack and no pack holds more than ``capacity`` tokens. The padding fraction is the
share of pack slots left empty, i.e. compute spent on nothing.
"""

from collections.abc import Sequence
from enum import StrEnum
from typing import Protocol

import numpy as np

Packs = list[list[int]]


class PackingStrategy(Protocol):
    name: str

    def pack(self, lengths: Sequence[int], capacity: int) -> Packs: ...


def _check(lengths: Sequence[int], capacity: int) -> None:
    if capacity < 1:
        raise ValueError(f"pack capacity must be >= 1, got {capacity}")
    too_long = [(i, n) for i, n in enumerate(lengths) if not 1 <= n <= capacity]
    if too_long:
        i, n = too_long[0]
        raise ValueError(f"sample {i} has length {n}; every sample must have 1..{capacity} tokens to be packed")


class SequentialPacking:
    """Keep the sample order; start a new pack when the next sample does not fit. Cheap and
    order-preserving, but leaves a hole at the end of a pack whenever a long sample follows."""

    name = "sequential"

    def pack(self, lengths: Sequence[int], capacity: int) -> Packs:
        _check(lengths, capacity)
        packs: Packs = []
        used = capacity
        for i, n in enumerate(lengths):
            if used + n > capacity:
                packs.append([])
                used = 0
            packs[-1].append(i)
            used += n
        return packs


class FirstFitDecreasing:
    """First-fit decreasing over a buffer of samples: longest first, each into the first pack
    with room. At most 11/9 OPT + 1 packs; in practice padding is near zero when short samples
    exist. ``buffer_size`` bounds how many samples are reordered together (None: all given)."""

    name = "ffd"

    def __init__(self, buffer_size: int | None = None) -> None:
        if buffer_size is not None and buffer_size < 1:
            raise ValueError(f"buffer_size must be >= 1 or None, got {buffer_size}")
        self.buffer_size = buffer_size

    def pack(self, lengths: Sequence[int], capacity: int) -> Packs:
        _check(lengths, capacity)
        size = self.buffer_size or max(1, len(lengths))
        packs: Packs = []
        for lo in range(0, len(lengths), size):
            packs.extend(self._pack_buffer(lengths, lo, min(lo + size, len(lengths)), capacity))
        return packs

    @staticmethod
    def _pack_buffer(lengths: Sequence[int], lo: int, hi: int, capacity: int) -> Packs:
        # Stable sort: equal lengths keep their order, so the result is deterministic.
        order = sorted(range(lo, hi), key=lambda i: -lengths[i])
        packs: Packs = []
        free: list[int] = []
        for i in order:
            n = lengths[i]
            for p, room in enumerate(free):
                if n <= room:
                    packs[p].append(i)
                    free[p] -= n
                    break
            else:
                packs.append([i])
                free.append(capacity - n)
        return packs


class Strategy(StrEnum):
    """Packing strategies by name (``data.thd.strategy``)."""

    ffd = "ffd"  # first-fit decreasing
    sequential = "sequential"


STRATEGIES = tuple(s.value for s in Strategy)


def packing_strategy(name: str, buffer_size: int | None = None) -> PackingStrategy:
    """``ffd`` (first-fit decreasing within ``buffer_size`` samples) or ``sequential``."""
    if name == "ffd":
        return FirstFitDecreasing(buffer_size)
    if name == "sequential":
        return SequentialPacking()
    raise ValueError(f"unknown packing strategy {name!r}; allowed: {', '.join(STRATEGIES)}")


def padding_fraction(lengths: Sequence[int], packs: Packs, capacity: int) -> float:
    """Empty slots / all slots when every pack is padded to ``capacity``."""
    if not packs:
        return 0.0
    used = int(np.sum([lengths[i] for pack in packs for i in pack]))
    return 1.0 - used / (len(packs) * capacity)
