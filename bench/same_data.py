"""The check every comparing bench makes before its numbers mean anything: each stack counted, on
its own, what it trained on at every step (tokens, digests of the token ids, ...), and the counts
agree."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class Counted(Protocol):
    name: str
    counts: list[dict]  # per step, counted by this stack itself


@dataclass
class StackCounts:
    """A stack's per-step counts, for benches without their own row type."""

    name: str
    counts: list[dict]


def check_same_data(rows: Sequence[Counted]) -> None:
    """Every stack trained on the same data at every step, or the comparison means nothing: exit
    naming the first step and count where a stack differs from the first one."""
    ref = rows[0]
    for r in rows[1:]:
        for step, (a, b) in enumerate(zip(ref.counts, r.counts, strict=False), 1):
            for key in a:
                if a[key] != b[key]:
                    raise SystemExit(f"{ref.name!r} and {r.name!r} trained different data: step {step} {key} "
                                     f"{a[key]} != {b[key]}")  # fmt: skip
        if len(ref.counts) != len(r.counts):
            raise SystemExit(f"{ref.name!r} ran {len(ref.counts)} steps, {r.name!r} {len(r.counts)}")
