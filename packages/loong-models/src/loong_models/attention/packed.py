"""Causal attention over packed (THD) sequences without a materialised mask: one SDPA call per
document segment of ``cu_seqlens``.

Why a per-segment loop and not FlexAttention: on CPU (and other non-CUDA devices) eager
FlexAttention falls back to a reference that materialises the [t, t] scores, and compiling it
needs a C++ toolchain and ~45 s per new shape on a 2-core host. A loop of causal SDPA calls is
exact, runs everywhere SDPA runs, lets torch pick its fused kernel per segment, and costs
O(sum L_i^2) instead of O(t^2). With Transformer Engine on CUDA, megatron's TE attention takes
THD natively and this path is not used.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def segment_bounds(cu_seqlens: torch.Tensor) -> list[int]:
    # One host read per call; packs hold tens of segments, so the loop is short.
    return [int(x) for x in cu_seqlens.tolist()]


def packed_causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float,
    dropout_p: float = 0.0,
    causal: bool = True,
) -> torch.Tensor:
    """``query`` [t, heads, d], ``key``/``value`` [t, groups, d] (GQA when groups < heads) ->
    [t, heads * d]; token ``i`` of segment ``s`` attends to tokens ``<= i`` of segment ``s`` only
    (``causal``), or to all tokens of segment ``s`` (``causal=False``: images, windows of a ViT)."""
    t, heads, d = query.shape
    bounds = segment_bounds(cu_seqlens)
    if bounds[0] != 0 or bounds[-1] != t:
        raise ValueError(
            f"cu_seqlens must run from 0 to the packed length {t}, got {bounds[0]}..{bounds[-1]}"
        )
    gqa = key.shape[1] != heads
    out = query.new_empty(t, heads, d)
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if hi == lo:
            continue
        # [L, h, d] -> [1, h, L, d]
        q, k, v = (x[lo:hi].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
        o = F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout_p, is_causal=causal, scale=scale, enable_gqa=gqa
        )
        out[lo:hi] = o.squeeze(0).transpose(0, 1)
    return out.reshape(t, heads * d)
