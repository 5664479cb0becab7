"""Rotary position embedding applied to megatron's fused QKV projection output, in plain torch.

Layout (megatron's ``mixed_qkv``, rows = sequence x batch x query groups): each row holds one
query group, ``[q_0 .. q_{R-1} | k | v]``, ``R = q_per_group`` heads of ``D`` values each. The
rotation is megatron's / TE's non-interleaved RoPE: ``x * cos + rotate_half(x) * sin`` with
``rotate_half([x1 | x2]) = [-x2 | x1]``; ``cos`` / ``sin`` are ``[positions, D]`` float32 tables
and a row's position is ``row // rows_per_pos``. Math in float32, outputs rounded once.
"""

from __future__ import annotations

import torch

from loong_kernels.reference._precision import acc


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def _rotate_transposed(dy: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The gradient of :func:`_rotate` w.r.t. ``x``: ``dy * cos + [z2 | -z1]`` with ``z = dy * sin``."""
    z1, z2 = (dy * sin).chunk(2, dim=-1)
    return dy * cos + torch.cat([z2, -z1], dim=-1)


def _tables(t: torch.Tensor, rows: int, rows_per_pos: int) -> torch.Tensor:
    return t[: rows // rows_per_pos].float()[:, None, None, :]


def qkv_rope_fwd(
    x: torch.Tensor, cos_q: torch.Tensor, sin_q: torch.Tensor, cos_k: torch.Tensor, sin_k: torch.Tensor,
    q_per_group: int, rows_per_pos: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [rows, (R + 2) D]`` -> rotated ``q [rows, R D]``, rotated ``k [rows, D]``, ``v [rows, D]``."""
    rows, width = x.shape
    d = width // (q_per_group + 2)
    xf = acc(x).view(rows // rows_per_pos, rows_per_pos, q_per_group + 2, d)
    cq, sq = _tables(cos_q, rows, rows_per_pos), _tables(sin_q, rows, rows_per_pos)
    ck, sk = _tables(cos_k, rows, rows_per_pos), _tables(sin_k, rows, rows_per_pos)
    q = _rotate(xf[:, :, :q_per_group], cq, sq)
    k = _rotate(xf[:, :, q_per_group : q_per_group + 1], ck, sk)
    v = xf[:, :, q_per_group + 1]
    return q.reshape(rows, q_per_group * d).to(x.dtype), k.reshape(rows, d).to(x.dtype), v.reshape(rows, d).to(x.dtype)


def qkv_rope_bwd(
    dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos_q: torch.Tensor, sin_q: torch.Tensor,
    cos_k: torch.Tensor, sin_k: torch.Tensor, q_per_group: int, rows_per_pos: int,
) -> torch.Tensor:
    """The gradient of :func:`qkv_rope_fwd` w.r.t. ``x``, in ``x``'s layout."""
    rows, d = dk.shape
    shape = (rows // rows_per_pos, rows_per_pos)
    cq, sq = _tables(cos_q, rows, rows_per_pos), _tables(sin_q, rows, rows_per_pos)
    ck, sk = _tables(cos_k, rows, rows_per_pos), _tables(sin_k, rows, rows_per_pos)
    dxq = _rotate_transposed(acc(dq).view(*shape, q_per_group, d), cq, sq)
    dxk = _rotate_transposed(acc(dk).view(*shape, 1, d), ck, sk)
    dx = torch.cat([dxq, dxk, acc(dv).view(*shape, 1, d)], dim=2)
    return dx.reshape(rows, (q_per_group + 2) * d).to(dq.dtype)
