"""Context-parallel core attention for :class:`SDPAttention` (local backend): ``p2p`` (ring,
:mod:`ring`) or ``a2a`` (all-to-all, "Ulysses": every rank trades its sequence slice of all
heads for the whole sequence of ``heads / cp`` heads, attends locally, and trades back).

Inputs are what megatron's attention hands to core attention on a CP rank: this rank's tokens
(the zigzag layout of :mod:`cp_layout`) with RoPE already applied at their true positions, and
for packed (THD) data ``cu_seqlens`` of the full sequences.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from loong_models.attention.cp_layout import token_layout
from loong_models.attention.packed import packed_causal_attention, segment_bounds
from loong_models.attention.ring import RingAttention

CP_COMM_TYPES = ("p2p", "a2a")


def _layouts(local_len: int, group, cu_seqlens: list[int] | None, causal: bool = True) -> list:
    cp = group.size()
    if not causal and cu_seqlens is None:  # bidirectional over one sequence: positions do not matter
        return [(torch.zeros(local_len, dtype=torch.long), torch.zeros(local_len, dtype=torch.long))] * cp
    return [token_layout(local_len, cp, r, cu_seqlens) for r in range(cp)]


def ring_attention(query, key, value, *, scale: float, group, cu_seqlens: list[int] | None,
                   causal: bool = True) -> torch.Tensor:  # fmt: skip
    """megatron layout: [s, b, heads, d] (THD: [t, heads, d]) -> [s, b, heads * dv] ([t, heads * dv])."""
    thd = query.dim() == 3
    if thd:
        query, key, value = (x.unsqueeze(1) for x in (query, key, value))
    s, b, h, _ = query.shape
    g = key.shape[2]
    dtype = query.dtype
    # [s, b, h, d] -> [b, g, r, s, d]; fp32 inside (the online softmax sums over cp blocks)
    q = query.float().permute(1, 2, 0, 3).reshape(b, g, h // g, s, -1)
    k, v = (x.float().permute(1, 2, 0, 3) for x in (key, value))
    out = RingAttention.apply(q, k, v, scale, group, _layouts(s, group, cu_seqlens, causal), causal)
    out = out.reshape(b, h, s, -1).permute(2, 0, 1, 3).reshape(s, b, -1).to(dtype)
    return out.squeeze(1) if thd else out


def _whole_order(local_len: int, group, cu_seqlens: list[int] | None, causal: bool, device) -> torch.Tensor:
    """The permutation that puts the gathered (rank-major) tokens in sequence order. Bidirectional
    attention over one sequence needs none (every query sees every key)."""
    if not causal and cu_seqlens is None:
        return torch.arange(local_len * group.size(), device=device)
    layouts = _layouts(local_len, group, cu_seqlens)
    starts = torch.tensor(cu_seqlens[:-1]) if cu_seqlens is not None else torch.zeros(1, dtype=torch.long)
    # index in the whole sequence of each gathered (rank-major) token
    return torch.argsort(torch.cat([pos + starts[seg] for pos, seg in layouts]).to(device))


class _AllToAll(torch.autograd.Function):
    """``to_heads``: [s_local, b, h, d] -> [cp * s_local, b, h / cp, d] (rank-major sequence);
    otherwise the inverse. Backward is the opposite exchange."""

    @staticmethod
    def forward(ctx, x, group, to_heads: bool):
        ctx.group, ctx.to_heads = group, to_heads
        return _exchange(x, group, to_heads)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad.contiguous(), ctx.group, not ctx.to_heads), None, None


def _exchange(x: torch.Tensor, group, to_heads: bool) -> torch.Tensor:
    cp = group.size()
    if to_heads:
        s, b, h, d = x.shape
        send = x.reshape(s, b, cp, h // cp, d).permute(2, 0, 1, 3, 4).contiguous()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        return recv.reshape(cp * s, b, h // cp, d)
    full, b, hl, d = x.shape
    send = x.reshape(cp, full // cp, b, hl, d).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 2, 0, 3, 4).reshape(full // cp, b, cp * hl, d)


def a2a_attention(query, key, value, *, scale: float, group, cu_seqlens: list[int] | None,
                  causal: bool = True) -> torch.Tensor:  # fmt: skip
    """Same contract as :func:`ring_attention`; needs heads and key/value groups divisible by cp."""
    thd = query.dim() == 3
    if thd:
        query, key, value = (x.unsqueeze(1) for x in (query, key, value))
    s = query.shape[0]
    order = _whole_order(s, group, cu_seqlens, causal, query.device)
    q, k, v = (_AllToAll.apply(x, group, True)[order] for x in (query, key, value))
    if cu_seqlens is not None:
        cu = torch.tensor(cu_seqlens, dtype=torch.int32)
        out = packed_causal_attention(q.squeeze(1), k.squeeze(1), v.squeeze(1), cu, scale=scale, causal=causal)
        out = out.view(q.shape[0], 1, q.shape[2], -1)
    else:
        qb, kb, vb = (x.permute(1, 2, 0, 3) for x in (q, k, v))
        out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=causal, scale=scale,
                                             enable_gqa=kb.shape[1] != qb.shape[1])  # fmt: skip
        out = out.permute(2, 0, 1, 3)
    out = _AllToAll.apply(out[torch.argsort(order)].contiguous(), group, False)
    out = out.reshape(s, out.shape[1], -1)
    return out.squeeze(1) if thd else out


def context_parallel_attention(query, key, value, *, comm_type: str, scale: float, group,
                               cu_seqlens: torch.Tensor | None, causal: bool = True) -> torch.Tensor:  # fmt: skip
    """Causal (or bidirectional) attention of this CP rank's tokens against the whole sequence(s)."""
    cu = segment_bounds(cu_seqlens) if cu_seqlens is not None else None
    run = {"p2p": ring_attention, "a2a": a2a_attention}[comm_type]
    return run(query, key, value, scale=scale, group=group, cu_seqlens=cu, causal=causal)
