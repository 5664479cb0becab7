"""How closely two implementations of an op agree: the checks the autotuner and
bench/dsa_vs_megatron.py apply before a candidate's time counts."""

from __future__ import annotations

import torch


def rel_diff(out: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """The largest max |a - b| / max |b| over the tensors."""
    return max(((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-12)).item()
               for a, b in zip(out, ref, strict=True))  # fmt: skip


def summed_rel_diff(out: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """For outputs summed over many tokens in 16-bit chunks (linear + cross-entropy's dW, rounded
    once per chunk, and chunked differently by each implementation): over the tensors, the largest
    of ``||a - b|| / ||b||`` and a quarter of ``max |a - b| / max |b|``.

    Each rounding of a partial sum moves it by up to 2^-9 of itself, so two such sums differ by
    noise growing like the square root of their chunk counts: ~1e-2 of the norm for 64 chunks
    against 4 (tests/test_agreement.py), and single entries, where partial sums cancel, by more
    (an H100 run: max |a - b| = 2.03% of the largest entry of llama3.2-1b's 128256 x 2048 dW over
    49,152 tokens, the torch reference rounding 94 chunks and the TileLang loop 24). A lost chunk
    or row, or a wrong entry, moves the norm or one entry by far more."""
    worst = 0.0
    for a, b in zip(out, ref, strict=True):
        d, r = a.float() - b.float(), b.float()
        norm = (torch.linalg.vector_norm(d) / torch.linalg.vector_norm(r).clamp(min=1e-12)).item()
        peak = (d.abs().max() / r.abs().max().clamp(min=1e-12)).item() if r.numel() else 0.0
        worst = max(worst, norm, peak / 4)
    return worst


def missed_fraction(out: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """The fraction of selected keys (``-1`` = none) that the reference did not select."""
    idx, want = out[0].long(), ref[0].long()
    n = max(int(want.max()) + 2, int(idx.max()) + 2)
    chosen = torch.zeros(want.shape[0], n, dtype=torch.bool, device=want.device)
    chosen.scatter_(1, want + 1, True)
    hit = chosen.gather(1, idx + 1) | (idx < 0)
    selected = (idx >= 0).sum().clamp(min=1)
    return 1.0 - ((hit & (idx >= 0)).sum() / selected).item()
