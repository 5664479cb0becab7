"""How closely two implementations of an op agree: the checks the autotuner and
bench/dsa_vs_megatron.py apply before a candidate's time counts."""

from __future__ import annotations

import torch


def rel_diff(out: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """The largest max |a - b| / max |b| over the tensors."""
    return max(((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-12)).item()
               for a, b in zip(out, ref, strict=True))  # fmt: skip


def missed_fraction(out: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """The fraction of selected keys (``-1`` = none) that the reference did not select."""
    idx, want = out[0].long(), ref[0].long()
    n = max(int(want.max()) + 2, int(idx.max()) + 2)
    chosen = torch.zeros(want.shape[0], n, dtype=torch.bool, device=want.device)
    chosen.scatter_(1, want + 1, True)
    hit = chosen.gather(1, idx + 1) | (idx < 0)
    selected = (idx >= 0).sum().clamp(min=1)
    return 1.0 - ((hit & (idx >= 0)).sum() / selected).item()
