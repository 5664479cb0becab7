"""Causal attention over packed (THD) sequences without a materialised mask: one SDPA call per
segment length of ``cu_seqlens`` (the segments of one length batched together).

Why a per-segment loop and not FlexAttention: on CPU (and other non-CUDA devices) eager
FlexAttention falls back to a reference that materialises the [t, t] scores, and compiling it
needs a C++ toolchain and ~45 s per new shape on a 2-core host. A loop of causal SDPA calls is
exact, runs everywhere SDPA runs, lets torch pick its fused kernel per segment, and costs
O(sum L_i^2) instead of O(t^2). With Transformer Engine on CUDA, an LLM's attention is TE's (THD
natively); a ViT's stays here (see specs.vision_block_spec), where its equal-sized windows and
frames are one batched flash-attention call per layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from loong_models.host import to_device
from loong_models.packed_seq import segments_by_length


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
    bounds: Sequence[int] | None = None,
    by_length: dict[int, list[int]] | None = None,
) -> torch.Tensor:
    """``query`` [t, heads, d], ``key``/``value`` [t, groups, d] (GQA when groups < heads) ->
    [t, heads * d]; token ``i`` of segment ``s`` attends to tokens ``<= i`` of segment ``s`` only
    (``causal``), or to all tokens of segment ``s`` (``causal=False``: images, windows of a ViT).
    ``bounds``: the values of ``cu_seqlens`` on the host, if known (no device read then);
    ``by_length``: ``segments_by_length(bounds)`` if already known (computed once per micro-batch)."""
    t, heads, d = query.shape
    bounds = list(bounds) if bounds is not None else segment_bounds(cu_seqlens)
    if bounds[0] != 0 or bounds[-1] != t:
        raise ValueError(
            f"cu_seqlens must run from 0 to the packed length {t}, got {bounds[0]}..{bounds[-1]}"
        )
    gqa = key.shape[1] != heads
    by_length = by_length if by_length is not None else segments_by_length(bounds)
    if len(by_length) == 1:
        ((length, starts),) = by_length.items()
        if len(starts) * length == t:  # equal segments tiling the pack (a ViT's windows / frames): no copies
            o = _attend(query, key, value, len(starts), length, scale, dropout_p, causal, gqa)
            return o.reshape(t, heads * d)
    out = query.new_empty(t, heads, d)
    # Segments of equal length (a ViT's windows, the frames of equal-sized images) go through one
    # batched SDPA call: hundreds of windows per micro-batch would otherwise be hundreds of tiny
    # kernel launches per layer on a GPU. When they tile the whole pack (above) the call reads the
    # projections in place: no row slices (each a zero-filled gradient + copy in backward), no
    # output buffer to copy into.
    for length, starts in by_length.items():
        if len(starts) == 1:
            rows = slice(starts[0], starts[0] + len(starts) * length)
        else:
            offsets = torch.arange(length, device=query.device)
            rows = (to_device(torch.tensor(starts), query.device)[:, None] + offsets).reshape(-1)
        out[rows] = _attend(
            query[rows], key[rows], value[rows], len(starts), length, scale, dropout_p, causal, gqa
        )
    return out.reshape(t, heads * d)


def _attend(query, key, value, n: int, length: int, scale: float, dropout_p: float, causal: bool, gqa: bool):
    """SDPA over ``n`` consecutive segments of ``length`` tokens each: [n * L, h, d] -> [n * L, h, d]."""
    q, k, v = (
        x.reshape(n, length, *x.shape[1:]).transpose(1, 2) for x in (query, key, value)
    )  # [n, h, L, d]
    o = F.scaled_dot_product_attention(
        q, k, v, dropout_p=dropout_p, is_causal=causal, scale=scale, enable_gqa=gqa
    )
    return o.transpose(1, 2).reshape(n * length, o.shape[1], o.shape[-1])
