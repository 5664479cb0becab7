"""Rotary position embedding on megatron's fused QKV projection output, as an autograd Function."""

from __future__ import annotations

from typing import Any

import torch

from loong_kernels.dispatch import call_with, choose, runs_tilelang


class QKVRoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, cos_q: torch.Tensor, sin_q: torch.Tensor, cos_k: torch.Tensor,
        sin_k: torch.Tensor, q_per_group: int, rows_per_pos: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        args = (x, cos_q, sin_q, cos_k, sin_k, q_per_group, rows_per_pos)
        ctx.impl = choose("qkv_rope_fwd", *args)
        ctx.save_for_backward(cos_q, sin_q, cos_k, sin_k)
        ctx.shape = (q_per_group, rows_per_pos)
        return call_with(ctx.impl, "qkv_rope_fwd", *args)

    @staticmethod
    def backward(ctx: Any, dq: torch.Tensor | None, dk: torch.Tensor | None, dv: torch.Tensor | None) -> tuple[Any, ...]:
        cos_q, sin_q, cos_k, sin_k = ctx.saved_tensors
        q_per_group, rows_per_pos = ctx.shape
        d = cos_q.shape[-1]
        grads = [g for g in (dq, dk, dv) if g is not None]
        rows = grads[0].shape[0]
        dq, dk, dv = (
            torch.zeros(rows, w, dtype=grads[0].dtype, device=grads[0].device) if g is None else g.contiguous()
            for g, w in ((dq, q_per_group * d), (dk, d), (dv, d))
        )
        args = (dq, dk, dv, cos_q, sin_q, cos_k, sin_k, q_per_group, rows_per_pos)
        impl = ctx.impl if choose("qkv_rope_bwd", *args) == ctx.impl else "reference"
        return call_with(impl, "qkv_rope_bwd", *args), None, None, None, None, None, None


def _fused_qkv_layout(qkv: torch.Tensor, q_per_group: int) -> bool:
    """``[seq, batch, groups, (q_per_group + 2) * head_dim]``."""
    return qkv.dim() == 4 and q_per_group >= 1 and qkv.shape[-1] % (q_per_group + 2) == 0


def _cos_sin(freqs: torch.Tensor, positions: int, head_dim: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    if freqs.shape[-1] != head_dim or freqs.numel() // head_dim < positions:
        raise ValueError(f"qkv_rope: {name} must hold at least {positions} positions of {head_dim} angles "
                         f"([positions, 1, 1, {head_dim}]), got {tuple(freqs.shape)}")  # fmt: skip
    angles = freqs.reshape(-1, head_dim)[:positions].float()
    return torch.cos(angles).contiguous(), torch.sin(angles).contiguous()


def qkv_rope(
    qkv: torch.Tensor, q_freqs: torch.Tensor, k_freqs: torch.Tensor, q_per_group: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split megatron's fused QKV output and rotate q and k (non-interleaved RoPE).

    ``qkv``: ``[seq, batch, groups, (q_per_group + 2) * head_dim]``, each group's
    ``[q_0 .. q_{R-1} | k | v]`` (megatron's ``mixed_qkv``); ``q_freqs`` / ``k_freqs``: the angles,
    ``[positions >= seq, 1, 1, head_dim]`` (megatron's rotary_pos_emb). Returns ``q [seq, batch,
    groups * q_per_group, head_dim]``, ``k`` and ``v [seq, batch, groups, head_dim]``: what TE's
    ``apply_fused_qkv_rotary_pos_emb`` returns for the sbhd format, one read and one write of each
    value, and the same gradients' layout in the backward."""
    if not _fused_qkv_layout(qkv, q_per_group):
        raise ValueError(f"qkv_rope: qkv must be [seq, batch, groups, ({q_per_group} + 2) * head_dim], "
                         f"got {tuple(qkv.shape)}")  # fmt: skip
    seq, batch, groups, width = qkv.shape
    d = width // (q_per_group + 2)
    if d % 2:
        raise ValueError(f"qkv_rope: head_dim must be even (two halves rotate), got {d}")
    cos_q, sin_q = _cos_sin(q_freqs, seq, d, "q_freqs")
    cos_k, sin_k = (cos_q, sin_q) if k_freqs is q_freqs else _cos_sin(k_freqs, seq, d, "k_freqs")
    q, k, v = QKVRoPEFunction.apply(qkv.reshape(-1, width).contiguous(), cos_q, sin_q, cos_k, sin_k, q_per_group,
                                    batch * groups)  # fmt: skip
    return q.view(seq, batch, groups * q_per_group, d), k.view(seq, batch, groups, d), v.view(seq, batch, groups, d)


def qkv_rope_uses_tilelang(qkv: torch.Tensor, q_per_group: int) -> bool:
    """Whether :func:`qkv_rope` runs its TileLang kernel for this ``qkv`` (no tables are built and
    no fallback warning is logged): for a caller with a fast kernel of its own to use otherwise."""
    if not _fused_qkv_layout(qkv, q_per_group):
        return False
    tables = qkv.new_empty((0, qkv.shape[-1] // (q_per_group + 2)), dtype=torch.float32)  # (shape and dtype checks only)
    return runs_tilelang("qkv_rope_fwd", qkv.reshape(-1, qkv.shape[-1]), tables, tables, tables, tables, q_per_group, 1)
