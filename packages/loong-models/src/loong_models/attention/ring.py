"""Ring (p2p) context-parallel attention, the algorithm of megatron/TE's ``cp_comm_type="p2p"``,
in plain torch so that it runs on every device (gloo on the CPU is how CI proves it).

Each rank holds a slice of every sequence's queries, keys and values (:mod:`cp_layout`). The
key/value slices travel around the ring of CP ranks; at each of the ``cp`` steps a rank attends
its queries to the block it holds and merges the result with an online softmax (running max and
sum), while the next block is already on its way. Backward replays the ring: each block's key /
value gradients travel with it and return to their owner after the last step. Causality across
ranks comes from the tokens' positions: a query sees a key of its own segment at an earlier or
equal position; with the zigzag layout every rank does the same amount of work. Bidirectional
attention (``causal=False``, e.g. a diffusion transformer's video tokens) lets a query see every
key of its segment, so any layout works.

Scores of one block are materialised ([b, heads, s_local, s_local]): this is the reference path
for devices without a fused kernel; on CUDA, Transformer Engine's attention does the same ring.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

NEG_INF = float("-inf")


class _Ring:
    """Sends a tensor to the next CP rank and receives the previous rank's."""

    def __init__(self, group: dist.ProcessGroup):
        self.group, self.size, self.rank = group, group.size(), group.rank()
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start(self, tensor: torch.Tensor):
        recv = torch.empty_like(tensor)
        ops = [dist.P2POp(dist.isend, tensor, self.next, self.group),
               dist.P2POp(dist.irecv, recv, self.prev, self.group)]  # fmt: skip
        return dist.batch_isend_irecv(ops), recv

    @staticmethod
    def finish(pending) -> torch.Tensor:
        works, recv = pending
        for work in works:
            work.wait()
        return recv


def _pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.cat([k.reshape(-1), v.reshape(-1)])


def _unpack(buf: torch.Tensor, k_shape, v_shape) -> tuple[torch.Tensor, torch.Tensor]:
    n = k_shape.numel()
    return buf[:n].view(k_shape), buf[n:].view(v_shape)


def _mask(q_layout, kv_layout, causal: bool) -> torch.Tensor:
    (q_pos, q_seg), (k_pos, k_seg) = q_layout, kv_layout
    same = q_seg[:, None] == k_seg[None, :]
    return same & (q_pos[:, None] >= k_pos[None, :]) if causal else same


def _scores(q, k, mask, scale) -> torch.Tensor:
    """q [b, g, r, sq, d] (r query heads per key/value group), k [b, g, sk, d]."""
    s = torch.einsum("bgrqd,bgkd->bgrqk", q, k) * scale
    return s.masked_fill(~mask, NEG_INF)


class RingAttention(torch.autograd.Function):
    """q [b, g, r, s, dk], k [b, g, s, dk], v [b, g, s, dv] (fp32) -> out [b, g, r, s, dv]."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float, group, layouts: list, causal: bool = True):
        ring = _Ring(group)
        mine = layouts[ring.rank]
        acc = q.new_zeros(*q.shape[:-1], v.shape[-1])
        m = q.new_full(q.shape[:-1], NEG_INF)
        denom = q.new_zeros(q.shape[:-1])
        kv = _pack(k, v)
        for step in range(ring.size):
            pending = ring.start(kv) if step < ring.size - 1 else None
            mask = _mask(mine, layouts[(ring.rank - step) % ring.size], causal)
            if mask.any():
                kb, vb = _unpack(kv, k.shape, v.shape)
                s = _scores(q, kb, mask, scale)
                m_new = torch.maximum(m, s.amax(-1))
                m_safe = torch.where(torch.isinf(m_new), 0.0, m_new)
                p = torch.exp(s - m_safe[..., None])
                alpha = torch.exp(m - m_safe)
                denom = denom * alpha + p.sum(-1)
                acc = acc * alpha[..., None] + torch.einsum("bgrqk,bgkd->bgrqd", p, vb)
                m = m_new
            if pending is not None:
                kv = _Ring.finish(pending)
        out = acc / denom[..., None]
        lse = m + torch.log(denom)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.group, ctx.layouts, ctx.causal = scale, group, layouts, causal
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale = _Ring(ctx.group), ctx.scale
        mine = ctx.layouts[ring.rank]
        dout = dout.contiguous()
        delta = (dout * out).sum(-1)
        dq = torch.zeros_like(q)
        kv = _pack(k, v)
        dkv = torch.zeros_like(kv)
        for step in range(ring.size):
            mask = _mask(mine, ctx.layouts[(ring.rank - step) % ring.size], ctx.causal)
            if mask.any():
                kb, vb = _unpack(kv, k.shape, v.shape)
                p = torch.exp(_scores(q, kb, mask, scale) - lse[..., None])
                dv = torch.einsum("bgrqk,bgrqd->bgkd", p, dout)
                ds = p * (torch.einsum("bgrqd,bgkd->bgrqk", dout, vb) - delta[..., None])
                dq += torch.einsum("bgrqk,bgkd->bgrqd", ds, kb) * scale
                dkv += _pack(torch.einsum("bgrqk,bgrqd->bgkd", ds, q) * scale, dv)
            if step < ring.size - 1:  # the block and its gradient move on together
                both = _Ring.finish(ring.start(torch.cat([kv, dkv])))
                kv, dkv = both[: kv.numel()], both[kv.numel() :]
        dkv = _Ring.finish(ring.start(dkv))  # home: the owner of the block held last
        dk, dv = _unpack(dkv, k.shape, v.shape)
        return dq, dk, dv, None, None, None, None
