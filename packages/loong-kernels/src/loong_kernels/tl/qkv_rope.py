"""RoPE on megatron's fused QKV rows in TileLang: one pass reads ``[q_0 .. q_{R-1} | k | v]`` and
writes rotated q, rotated k and v (the backward: the three gradients into one row).

Each thread pairs element ``j`` of a head's first half with element ``j`` of its second half, so
both loads and both stores run along contiguous memory (no gather of a rotated partner). The
cos / sin tables (``[positions, D]`` float32, a few hundred KB) stay in L2.
"""

import functools
from typing import Any

import tilelang.language as T
import torch

from loong_kernels.tl._common import compile_kernel, dtype_name

_BLOCK_ROWS, _THREADS = 16, 128


def _tables_fit(cos_q, sin_q, cos_k, sin_k) -> bool:
    # halves of a head in whole 16-byte vectors; every table float32 and contiguous
    tables = (cos_q, sin_q, cos_k, sin_k)
    return cos_q.shape[-1] % 16 == 0 and all(t.dtype == torch.float32 and t.is_contiguous() for t in tables)


def supports(x, cos_q, sin_q, cos_k, sin_k, q_per_group: int, rows_per_pos: int) -> bool:
    return _tables_fit(cos_q, sin_q, cos_k, sin_k) and x.is_contiguous()


def supports_bwd(dq, dk, dv, cos_q, sin_q, cos_k, sin_k, q_per_group: int, rows_per_pos: int) -> bool:
    return _tables_fit(cos_q, sin_q, cos_k, sin_k) and all(g.is_contiguous() for g in (dq, dk, dv))


@functools.cache
def build_fwd(q_per_group: int, head_dim: int, rows_per_pos: int, dtype: str, target: str = "auto") -> Any:
    rows, positions = T.dynamic("rows"), T.dynamic("positions")
    heads, half = q_per_group, head_dim // 2
    width = (q_per_group + 2) * head_dim

    @T.prim_func
    def qkv_rope_fwd_kernel(
        X: T.Tensor((rows, width), dtype),
        CQ: T.Tensor((positions, head_dim), "float32"),
        SQ: T.Tensor((positions, head_dim), "float32"),
        CK: T.Tensor((positions, head_dim), "float32"),
        SK: T.Tensor((positions, head_dim), "float32"),
        Q: T.Tensor((rows, heads * head_dim), dtype),
        K: T.Tensor((rows, head_dim), dtype),
        V: T.Tensor((rows, head_dim), dtype),
    ):
        with T.Kernel(T.ceildiv(rows, _BLOCK_ROWS), threads=_THREADS) as bx:
            for i, c in T.Parallel(_BLOCK_ROWS, heads * half):  # (one flat axis: any head count lays out)
                r, h, j = bx * _BLOCK_ROWS + i, c // half, c % half
                if r < rows:
                    p = r // rows_per_pos
                    x1 = T.cast(X[r, h * head_dim + j], "float32")
                    x2 = T.cast(X[r, h * head_dim + half + j], "float32")
                    Q[r, h * head_dim + j] = T.cast(x1 * CQ[p, j] - x2 * SQ[p, j], dtype)
                    Q[r, h * head_dim + half + j] = T.cast(x2 * CQ[p, half + j] + x1 * SQ[p, half + j], dtype)
            for i, j in T.Parallel(_BLOCK_ROWS, half):
                r = bx * _BLOCK_ROWS + i
                if r < rows:
                    p = r // rows_per_pos
                    k1 = T.cast(X[r, heads * head_dim + j], "float32")
                    k2 = T.cast(X[r, heads * head_dim + half + j], "float32")
                    K[r, j] = T.cast(k1 * CK[p, j] - k2 * SK[p, j], dtype)
                    K[r, half + j] = T.cast(k2 * CK[p, half + j] + k1 * SK[p, half + j], dtype)
            for i, j in T.Parallel(_BLOCK_ROWS, head_dim):
                r = bx * _BLOCK_ROWS + i
                if r < rows:
                    V[r, j] = X[r, (heads + 1) * head_dim + j]

    return compile_kernel(qkv_rope_fwd_kernel, target)


@functools.cache
def build_bwd(q_per_group: int, head_dim: int, rows_per_pos: int, dtype: str, target: str = "auto") -> Any:
    rows, positions = T.dynamic("rows"), T.dynamic("positions")
    heads, half = q_per_group, head_dim // 2
    width = (q_per_group + 2) * head_dim

    @T.prim_func
    def qkv_rope_bwd_kernel(
        DQ: T.Tensor((rows, heads * head_dim), dtype),
        DK: T.Tensor((rows, head_dim), dtype),
        DV: T.Tensor((rows, head_dim), dtype),
        CQ: T.Tensor((positions, head_dim), "float32"),
        SQ: T.Tensor((positions, head_dim), "float32"),
        CK: T.Tensor((positions, head_dim), "float32"),
        SK: T.Tensor((positions, head_dim), "float32"),
        DX: T.Tensor((rows, width), dtype),
    ):
        with T.Kernel(T.ceildiv(rows, _BLOCK_ROWS), threads=_THREADS) as bx:
            # dx = dy * cos + [z2 | -z1], z = dy * sin (the transpose of the rotation)
            for i, c in T.Parallel(_BLOCK_ROWS, heads * half):
                r, h, j = bx * _BLOCK_ROWS + i, c // half, c % half
                if r < rows:
                    p = r // rows_per_pos
                    g1 = T.cast(DQ[r, h * head_dim + j], "float32")
                    g2 = T.cast(DQ[r, h * head_dim + half + j], "float32")
                    DX[r, h * head_dim + j] = T.cast(g1 * CQ[p, j] + g2 * SQ[p, half + j], dtype)
                    DX[r, h * head_dim + half + j] = T.cast(g2 * CQ[p, half + j] - g1 * SQ[p, j], dtype)
            for i, j in T.Parallel(_BLOCK_ROWS, half):
                r = bx * _BLOCK_ROWS + i
                if r < rows:
                    p = r // rows_per_pos
                    g1 = T.cast(DK[r, j], "float32")
                    g2 = T.cast(DK[r, half + j], "float32")
                    DX[r, heads * head_dim + j] = T.cast(g1 * CK[p, j] + g2 * SK[p, half + j], dtype)
                    DX[r, heads * head_dim + half + j] = T.cast(g2 * CK[p, half + j] - g1 * SK[p, j], dtype)
            for i, j in T.Parallel(_BLOCK_ROWS, head_dim):
                r = bx * _BLOCK_ROWS + i
                if r < rows:
                    DX[r, (heads + 1) * head_dim + j] = DV[r, j]

    return compile_kernel(qkv_rope_bwd_kernel, target)


def qkv_rope_fwd(x, cos_q, sin_q, cos_k, sin_k, q_per_group: int, rows_per_pos: int):
    rows, d = x.shape[0], cos_q.shape[-1]
    q = torch.empty(rows, q_per_group * d, dtype=x.dtype, device=x.device)
    k = torch.empty(rows, d, dtype=x.dtype, device=x.device)
    v = torch.empty(rows, d, dtype=x.dtype, device=x.device)
    build_fwd(q_per_group, d, rows_per_pos, dtype_name(x.dtype))(x, cos_q, sin_q, cos_k, sin_k, q, k, v)
    return q, k, v


def qkv_rope_bwd(dq, dk, dv, cos_q, sin_q, cos_k, sin_k, q_per_group: int, rows_per_pos: int):
    rows, d = dk.shape
    dx = torch.empty(rows, (q_per_group + 2) * d, dtype=dk.dtype, device=dk.device)
    build_bwd(q_per_group, d, rows_per_pos, dtype_name(dk.dtype))(dq, dk, dv, cos_q, sin_q, cos_k, sin_k, dx)
    return dx
