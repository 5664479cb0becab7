"""Sparse MLA attention (DeepSeek-V3.2 DSA) in TileLang: forward, backward, head-mean probabilities.

One CTA handles one query token and a block of up to 64 of its heads; the heads are the M
dimension of every GEMM (they share the one latent KV head), the selected keys are gathered
``block`` rows at a time. Keys are ``[value dims | rope tail]``; the two parts are kept in
separate shared buffers so each GEMM has power-of-two-friendly shapes. Empty slots (index
``-1``) read row 0 and are masked out.
"""

import functools
from typing import Any

import tilelang.language as T
import torch

from loong_kernels.tl._common import LN2, LOG2E, compile_kernel, dtype_name

_FWD_BLOCK, _FWD_STAGES = 64, 2
_BWD_BLOCK = 32
# masked scores start here instead of -inf so that "max - max" never computes inf - inf
_NEG_BIG = -(2.0**30)


def _head_block(heads: int) -> int:
    return heads if heads <= 64 else 64


def _threads(head_block: int) -> int:
    # 8 warps need 64 head rows to split the GEMMs between them; smaller head blocks use 4
    return 256 if head_block >= 64 else 128


def _warps_fit(rows: int, cols: int, head_block: int) -> bool:
    """TileLang splits a GEMM's [rows, cols] output over the warps in 16 x 8 tiles: there must be
    at least one tile per warp (a 16-head block with a 16-wide RoPE tail fails to compile)."""
    return (rows // 16) * (cols // 8) >= _threads(head_block) // 32


def _shapes_ok(q: torch.Tensor, kv: torch.Tensor, d_v: int) -> bool:
    heads, d_qk = q.shape[1], q.shape[2]
    tail = d_qk - d_v
    heads_ok = heads % 16 == 0 and (heads <= 64 or heads % 64 == 0)
    dims_ok = d_v % 64 == 0 and tail > 0 and tail % 16 == 0
    bh = _head_block(heads)
    # the kernels declare one token count for queries and keys; a context-parallel rank's queries
    # are a part of the keys (its selection indexes the whole sequence): the reference runs those
    same_tokens = q.shape[0] == kv.shape[0]
    return heads_ok and dims_ok and same_tokens and _warps_fit(bh, tail, bh) and kv.dtype == q.dtype


def supports(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, d_v: int, scale: float) -> bool:
    return _shapes_ok(q, kv, d_v)


def supports_bwd(q, kv, out, dout, indices, lse, d_v: int, scale: float) -> bool:  # noqa: ANN001
    return _shapes_ok(q, kv, d_v)


def _probs_value_dims(d_qk: int) -> int:
    """How the probabilities kernel splits keys: any ``64k + tail`` works, as no values are read."""
    return d_qk - (d_qk % 64 or 64)


def supports_probs(q, kv, indices, lse, scale: float) -> bool:  # noqa: ANN001
    d_v = _probs_value_dims(q.shape[2])
    return d_v > 0 and _shapes_ok(q, kv, d_v)


def _pad_indices(indices: torch.Tensor, block: int) -> torch.Tensor:
    """Pad the top-k dim with empty slots up to a multiple of the kernel's key block."""
    k = indices.shape[1]
    pad = -k % block
    return torch.nn.functional.pad(indices, (0, pad), value=-1).contiguous() if pad else indices


@functools.cache
def build_fwd(heads: int, d_v: int, d_tail: int, topk: int, scale: float, dtype: str, target: str = "auto") -> Any:
    """Forward for ``topk`` a multiple of the key block; ``scale`` multiplies ``q . k``."""
    n = T.dynamic("tokens")
    bh = _head_block(heads)
    n_hblk = heads // bh
    bi = _FWD_BLOCK
    scale2 = scale * LOG2E  # softmax in base 2: exp(x) = exp2(x * log2 e)

    @T.prim_func
    def sparse_mla_fwd_kernel(
        Q: T.Tensor((n, heads, d_v + d_tail), dtype),
        KV: T.Tensor((n, d_v + d_tail), dtype),
        Idx: T.Tensor((n, topk), "int32"),
        Out: T.Tensor((n, heads, d_v), dtype),
        Lse: T.Tensor((n, heads), "float32"),
    ):
        with T.Kernel(n * n_hblk, threads=_threads(bh)) as bx:
            t = bx // n_hblk
            h0 = (bx % n_hblk) * bh
            q_s = T.alloc_shared((bh, d_v), dtype)
            qt_s = T.alloc_shared((bh, d_tail), dtype)
            k_s = T.alloc_shared((bi, d_v), dtype)
            kt_s = T.alloc_shared((bi, d_tail), dtype)
            p_s = T.alloc_shared((bh, bi), dtype)
            o_s = T.alloc_shared((bh, d_v), dtype)
            valid = T.alloc_fragment((bi,), "bool")
            acc_s = T.alloc_fragment((bh, bi), "float32")
            acc_o = T.alloc_fragment((bh, d_v), "float32")
            m = T.alloc_fragment((bh,), "float32")
            m_prev = T.alloc_fragment((bh,), "float32")
            row_sum = T.alloc_fragment((bh,), "float32")
            blk_sum = T.alloc_fragment((bh,), "float32")
            alpha = T.alloc_fragment((bh,), "float32")

            T.copy(Q[t, h0 : h0 + bh, :d_v], q_s)
            T.copy(Q[t, h0 : h0 + bh, d_v:], qt_s)
            T.fill(acc_o, 0)
            T.fill(row_sum, 0)
            T.fill(m, _NEG_BIG)

            for kb in T.Pipelined(topk // bi, num_stages=_FWD_STAGES):
                for i in T.Parallel(bi):
                    valid[i] = Idx[t, kb * bi + i] >= 0
                for i, d in T.Parallel(bi, d_v):
                    k_s[i, d] = KV[T.max(Idx[t, kb * bi + i], 0), d]
                for i, d in T.Parallel(bi, d_tail):
                    kt_s[i, d] = KV[T.max(Idx[t, kb * bi + i], 0), d_v + d]
                for h, i in T.Parallel(bh, bi):
                    acc_s[h, i] = T.if_then_else(valid[i], 0, -T.infinity("float32"))
                T.gemm(q_s, k_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                T.gemm(qt_s, kt_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)

                # online softmax: rescale what was accumulated to the new running max
                T.copy(m, m_prev)
                T.reduce_max(acc_s, m, dim=1, clear=False)
                for h in T.Parallel(bh):
                    alpha[h] = T.exp2((m_prev[h] - m[h]) * scale2)
                for h, i in T.Parallel(bh, bi):
                    acc_s[h, i] = T.exp2(acc_s[h, i] * scale2 - m[h] * scale2)
                T.reduce_sum(acc_s, blk_sum, dim=1)
                for h in T.Parallel(bh):
                    row_sum[h] = row_sum[h] * alpha[h] + blk_sum[h]
                for h, d in T.Parallel(bh, d_v):
                    acc_o[h, d] = acc_o[h, d] * alpha[h]
                T.copy(acc_s, p_s)
                T.gemm(p_s, k_s, acc_o, policy=T.GemmWarpPolicy.FullRow)

            # a query with no selected key: output 0, LSE -inf (as the reference)
            for h, d in T.Parallel(bh, d_v):
                acc_o[h, d] = T.if_then_else(row_sum[h] > 0, acc_o[h, d] / row_sum[h], 0)
            for h in T.Parallel(bh):
                Lse[t, h0 + h] = T.if_then_else(
                    row_sum[h] > 0, (T.log2(row_sum[h]) + m[h] * scale2) * LN2, -T.infinity("float32")
                )
            T.copy(acc_o, o_s)
            T.copy(o_s, Out[t, h0 : h0 + bh, :])

    return compile_kernel(sparse_mla_fwd_kernel, target)


@functools.cache
def build_bwd(heads: int, d_v: int, d_tail: int, topk: int, scale: float, dtype: str, target: str = "auto") -> Any:
    """Backward: writes ``dQ`` and accumulates ``dKV`` (float32, zero-initialised) atomically."""
    n = T.dynamic("tokens")
    bh = _head_block(heads)
    n_hblk = heads // bh
    bs = _BWD_BLOCK
    scale2 = scale * LOG2E

    @T.prim_func
    def sparse_mla_bwd_kernel(
        Q: T.Tensor((n, heads, d_v + d_tail), dtype),
        KV: T.Tensor((n, d_v + d_tail), dtype),
        DO: T.Tensor((n, heads, d_v), dtype),
        Idx: T.Tensor((n, topk), "int32"),
        Lse: T.Tensor((n, heads), "float32"),
        Delta: T.Tensor((n, heads), "float32"),
        DQ: T.Tensor((n, heads, d_v + d_tail), dtype),
        DKV: T.Tensor((n, d_v + d_tail), "float32"),
    ):
        with T.Kernel(n * n_hblk, threads=_threads(bh)) as bx:
            t = bx // n_hblk
            h0 = (bx % n_hblk) * bh
            q_s = T.alloc_shared((bh, d_v), dtype)
            qt_s = T.alloc_shared((bh, d_tail), dtype)
            do_s = T.alloc_shared((bh, d_v), dtype)
            k_s = T.alloc_shared((bs, d_v), dtype)
            kt_s = T.alloc_shared((bs, d_tail), dtype)
            p_s = T.alloc_shared((bh, bs), dtype)
            ds_s = T.alloc_shared((bh, bs), dtype)
            dq_s = T.alloc_shared((bh, d_v), dtype)
            dqt_s = T.alloc_shared((bh, d_tail), dtype)
            # shared, not a fragment: it is read under the layouts of several different fragments
            idx = T.alloc_shared((bs,), "int32")
            lse2 = T.alloc_fragment((bh,), "float32")
            delta = T.alloc_fragment((bh,), "float32")
            acc_p = T.alloc_fragment((bh, bs), "float32")
            acc_dp = T.alloc_fragment((bh, bs), "float32")
            acc_dq = T.alloc_fragment((bh, d_v), "float32")
            acc_dqt = T.alloc_fragment((bh, d_tail), "float32")
            acc_dk = T.alloc_fragment((bs, d_v), "float32")
            acc_dkt = T.alloc_fragment((bs, d_tail), "float32")

            T.copy(Q[t, h0 : h0 + bh, :d_v], q_s)
            T.copy(Q[t, h0 : h0 + bh, d_v:], qt_s)
            T.copy(DO[t, h0 : h0 + bh, :], do_s)
            for h in T.Parallel(bh):
                lse2[h] = Lse[t, h0 + h] * LOG2E
                delta[h] = Delta[t, h0 + h]
            T.clear(acc_dq)
            T.clear(acc_dqt)

            for kb in T.serial(topk // bs):
                for i in T.Parallel(bs):
                    idx[i] = Idx[t, kb * bs + i]
                for i, d in T.Parallel(bs, d_v):
                    k_s[i, d] = KV[T.max(Idx[t, kb * bs + i], 0), d]
                for i, d in T.Parallel(bs, d_tail):
                    kt_s[i, d] = KV[T.max(Idx[t, kb * bs + i], 0), d_v + d]
                T.clear(acc_p)
                T.gemm(q_s, k_s, acc_p, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
                T.gemm(qt_s, kt_s, acc_p, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
                # P = exp(scale * s - lse), recomputed from the forward's LSE; 0 at empty slots
                for h, i in T.Parallel(bh, bs):
                    acc_p[h, i] = T.if_then_else(idx[i] >= 0, T.exp2(acc_p[h, i] * scale2 - lse2[h]), 0)
                T.copy(acc_p, p_s)
                T.clear(acc_dp)
                T.gemm(do_s, k_s, acc_dp, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
                # dS = P * (dP - delta) * scale, the softmax backward
                for h, i in T.Parallel(bh, bs):
                    acc_dp[h, i] = acc_p[h, i] * (acc_dp[h, i] - delta[h]) * scale
                T.copy(acc_dp, ds_s)
                T.gemm(ds_s, k_s, acc_dq, policy=T.GemmWarpPolicy.FullCol)
                T.gemm(ds_s, kt_s, acc_dqt, policy=T.GemmWarpPolicy.FullCol)
                # dK = dS^T Q (+ P^T dO for the value part), scattered to the selected rows
                T.clear(acc_dk)
                T.clear(acc_dkt)
                T.gemm(ds_s, q_s, acc_dk, transpose_A=True, policy=T.GemmWarpPolicy.FullCol)
                T.gemm(p_s, do_s, acc_dk, transpose_A=True, policy=T.GemmWarpPolicy.FullCol)
                T.gemm(ds_s, qt_s, acc_dkt, transpose_A=True, policy=T.GemmWarpPolicy.FullCol)
                for i, d in T.Parallel(bs, d_v):
                    if idx[i] >= 0:
                        T.atomic_add(DKV[idx[i], d], acc_dk[i, d])
                for i, d in T.Parallel(bs, d_tail):
                    if idx[i] >= 0:
                        T.atomic_add(DKV[idx[i], d_v + d], acc_dkt[i, d])

            T.copy(acc_dq, dq_s)
            T.copy(acc_dqt, dqt_s)
            T.copy(dq_s, DQ[t, h0 : h0 + bh, :d_v])
            T.copy(dqt_s, DQ[t, h0 : h0 + bh, d_v:])

    return compile_kernel(sparse_mla_bwd_kernel, target)


@functools.cache
def build_head_mean_probs(
    heads: int, d_v: int, d_tail: int, topk: int, scale: float, dtype: str, target: str = "auto"
) -> Any:
    """``P[t, k] += sum_h exp(scale * q . k - lse) / heads`` into a zero-initialised float32 output."""
    n = T.dynamic("tokens")
    bh = _head_block(heads)
    n_hblk = heads // bh
    bi = _FWD_BLOCK
    scale2 = scale * LOG2E

    @T.prim_func
    def head_mean_probs_kernel(
        Q: T.Tensor((n, heads, d_v + d_tail), dtype),
        KV: T.Tensor((n, d_v + d_tail), dtype),
        Idx: T.Tensor((n, topk), "int32"),
        Lse: T.Tensor((n, heads), "float32"),
        P: T.Tensor((n, topk), "float32"),
    ):
        with T.Kernel(n * n_hblk, threads=_threads(bh)) as bx:
            t = bx // n_hblk
            h0 = (bx % n_hblk) * bh
            q_s = T.alloc_shared((bh, d_v), dtype)
            qt_s = T.alloc_shared((bh, d_tail), dtype)
            k_s = T.alloc_shared((bi, d_v), dtype)
            kt_s = T.alloc_shared((bi, d_tail), dtype)
            valid = T.alloc_fragment((bi,), "bool")
            lse2 = T.alloc_fragment((bh,), "float32")
            acc_s = T.alloc_fragment((bh, bi), "float32")
            col = T.alloc_fragment((bi,), "float32")

            T.copy(Q[t, h0 : h0 + bh, :d_v], q_s)
            T.copy(Q[t, h0 : h0 + bh, d_v:], qt_s)
            for h in T.Parallel(bh):
                lse2[h] = Lse[t, h0 + h] * LOG2E
            for kb in T.Pipelined(topk // bi, num_stages=_FWD_STAGES):
                for i in T.Parallel(bi):
                    valid[i] = Idx[t, kb * bi + i] >= 0
                for i, d in T.Parallel(bi, d_v):
                    k_s[i, d] = KV[T.max(Idx[t, kb * bi + i], 0), d]
                for i, d in T.Parallel(bi, d_tail):
                    kt_s[i, d] = KV[T.max(Idx[t, kb * bi + i], 0), d_v + d]
                T.clear(acc_s)
                T.gemm(q_s, k_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                T.gemm(qt_s, kt_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                for h, i in T.Parallel(bh, bi):
                    acc_s[h, i] = T.if_then_else(valid[i], T.exp2(acc_s[h, i] * scale2 - lse2[h]), 0) / heads
                T.reduce_sum(acc_s, col, dim=0)
                for i in T.Parallel(bi):
                    if n_hblk == 1:
                        P[t, kb * bi + i] = col[i]
                    else:
                        T.atomic_add(P[t, kb * bi + i], col[i])

    return compile_kernel(head_mean_probs_kernel, target)


def sparse_mla_fwd(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, d_v: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    n, heads, d_qk = q.shape
    idx = _pad_indices(indices, _FWD_BLOCK)
    kernel = build_fwd(heads, d_v, d_qk - d_v, idx.shape[1], float(scale), dtype_name(q.dtype))
    out = torch.empty(n, heads, d_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(n, heads, dtype=torch.float32, device=q.device)
    kernel(q, kv, idx, out, lse)
    return out, lse


def sparse_mla_bwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    out: torch.Tensor,
    dout: torch.Tensor,
    indices: torch.Tensor,
    lse: torch.Tensor,
    d_v: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    n, heads, d_qk = q.shape
    idx = _pad_indices(indices, _BWD_BLOCK)
    kernel = build_bwd(heads, d_v, d_qk - d_v, idx.shape[1], float(scale), dtype_name(q.dtype))
    # delta = rowsum(dO * O) is one memory-bound pass; torch does it well enough
    delta = (dout.float() * out.float()).sum(-1)
    dq = torch.empty_like(q)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    kernel(q, kv, dout, idx, lse, delta, dq, dkv)
    return dq, dkv.to(kv.dtype)


def sparse_attention_head_mean_probs(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, lse: torch.Tensor, scale: float
) -> torch.Tensor:
    n, heads, d_qk = q.shape
    d_v = _probs_value_dims(d_qk)
    k = indices.shape[1]
    idx = _pad_indices(indices, _FWD_BLOCK)
    kernel = build_head_mean_probs(heads, d_v, d_qk - d_v, idx.shape[1], float(scale), dtype_name(q.dtype))
    probs = torch.zeros(n, idx.shape[1], dtype=torch.float32, device=q.device)
    kernel(q, kv, idx, lse, probs)
    return probs[:, :k]
