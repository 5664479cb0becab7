"""Lightning indexer (DeepSeek-V3.2 DSA) in TileLang.

* :func:`indexer_scores`: the dense causal score matrix used for top-k selection. A CTA owns a
  ``[block_m queries, block_n keys]`` tile, loops over the indexer heads (one GEMM each, ReLU,
  weighted by ``w``) and skips tiles above the diagonal (left at ``-inf``).
* :func:`indexer_topk_logits_fwd` / ``_bwd``: the scores of the selected keys only, for the
  indexer's KL loss, and their gradients. A CTA owns one query token with all its heads as the
  GEMM M dimension; ``dk_i`` is accumulated with float32 atomics.
"""

import functools
from typing import Any

import tilelang.language as T
import torch

from loong_kernels.tl._common import compile_kernel, dtype_name

_SCORE_BM, _SCORE_BN, _SCORE_THREADS = 128, 128, 256
_TOPK_BLOCK, _TOPK_THREADS = 64, 128


def _indexer_shapes_ok(q_i: torch.Tensor, k_i: torch.Tensor, w: torch.Tensor) -> bool:
    heads, dim = q_i.shape[1], q_i.shape[2]
    same_tokens = q_i.shape[0] == k_i.shape[0]  # one token count in the kernels (see sparse_mla._shapes_ok)
    return heads % 16 == 0 and heads <= 128 and dim % 16 == 0 and same_tokens and k_i.dtype == q_i.dtype == w.dtype


def supports_scores(q_i: torch.Tensor, k_i: torch.Tensor, w: torch.Tensor, starts: torch.Tensor) -> bool:
    return _indexer_shapes_ok(q_i, k_i, w)


def supports_indexer_topk(q_i: torch.Tensor, k_i: torch.Tensor, w: torch.Tensor, starts: torch.Tensor, topk: int) -> bool:
    return _indexer_shapes_ok(q_i, k_i, w)


def supports_topk(q_i: torch.Tensor, k_i: torch.Tensor, w: torch.Tensor, indices: torch.Tensor) -> bool:
    return _indexer_shapes_ok(q_i, k_i, w)


def supports_topk_bwd(dlogits, q_i, k_i, w, indices) -> bool:  # noqa: ANN001
    return _indexer_shapes_ok(q_i, k_i, w)


@functools.cache
def build_scores(heads: int, dim: int, dtype: str, target: str = "auto") -> Any:
    """Writes the causal tiles of ``Out`` (pre-filled with -inf); ``-inf`` outside each document."""
    n = T.dynamic("tokens")
    bm, bn = _SCORE_BM, _SCORE_BN

    @T.prim_func
    def indexer_scores_kernel(
        Qi: T.Tensor((n, heads, dim), dtype),
        Ki: T.Tensor((n, dim), dtype),
        W: T.Tensor((n, heads), dtype),
        Starts: T.Tensor((n,), "int32"),
        Out: T.Tensor((n, n), "float32"),
    ):
        with T.Kernel(T.ceildiv(n, bn), T.ceildiv(n, bm), threads=_SCORE_THREADS) as (kb, qb):
            # tiles entirely above the diagonal have no allowed key
            if kb * bn <= qb * bm + bm - 1:
                q_s = T.alloc_shared((bm, dim), dtype)
                k_s = T.alloc_shared((bn, dim), dtype)
                w_s = T.alloc_shared((bm, heads), dtype)
                acc = T.alloc_fragment((bm, bn), "float32")
                score = T.alloc_fragment((bm, bn), "float32")
                T.copy(Ki[kb * bn, 0], k_s)
                T.copy(W[qb * bm, 0], w_s)
                T.clear(score)
                for h in T.Pipelined(heads, num_stages=2):
                    T.copy(Qi[qb * bm : qb * bm + bm, h, :], q_s)
                    T.clear(acc)
                    T.gemm(q_s, k_s, acc, transpose_B=True)
                    for i, j in T.Parallel(bm, bn):
                        score[i, j] += T.max(acc[i, j], 0) * T.cast(w_s[i, h], "float32")
                for i, j in T.Parallel(bm, bn):
                    q, k = qb * bm + i, kb * bn + j
                    if q < n and k < n:
                        Out[q, k] = T.if_then_else(k <= q and k >= Starts[q], score[i, j], -T.infinity("float32"))

    return compile_kernel(indexer_scores_kernel, target)


@functools.cache
def build_topk_logits_fwd(heads: int, dim: int, topk: int, dtype: str, target: str = "auto") -> Any:
    n = T.dynamic("tokens")
    bk = _TOPK_BLOCK

    @T.prim_func
    def indexer_topk_logits_fwd_kernel(
        Qi: T.Tensor((n, heads, dim), dtype),
        Ki: T.Tensor((n, dim), dtype),
        W: T.Tensor((n, heads), dtype),
        Idx: T.Tensor((n, topk), "int32"),
        Logits: T.Tensor((n, topk), "float32"),
    ):
        with T.Kernel(n, threads=_TOPK_THREADS) as t:
            q_s = T.alloc_shared((heads, dim), dtype)
            k_s = T.alloc_shared((bk, dim), dtype)
            idx = T.alloc_shared((bk,), "int32")
            w = T.alloc_fragment((heads,), "float32")
            acc = T.alloc_fragment((heads, bk), "float32")
            col = T.alloc_fragment((bk,), "float32")
            T.copy(Qi[t, :, :], q_s)
            for h in T.Parallel(heads):
                w[h] = T.cast(W[t, h], "float32")
            for kb in T.Pipelined(topk // bk, num_stages=2):
                for i in T.Parallel(bk):
                    idx[i] = Idx[t, kb * bk + i]
                for i, d in T.Parallel(bk, dim):
                    k_s[i, d] = Ki[T.max(Idx[t, kb * bk + i], 0), d]
                T.clear(acc)
                T.gemm(q_s, k_s, acc, transpose_B=True)
                for h, i in T.Parallel(heads, bk):
                    acc[h, i] = T.max(acc[h, i], 0) * w[h]
                T.reduce_sum(acc, col, dim=0)
                for i in T.Parallel(bk):
                    Logits[t, kb * bk + i] = T.if_then_else(idx[i] >= 0, col[i], -T.infinity("float32"))

    return compile_kernel(indexer_topk_logits_fwd_kernel, target)


@functools.cache
def build_topk_logits_bwd(heads: int, dim: int, topk: int, dtype: str, target: str = "auto") -> Any:
    """Writes ``dQi``, ``dW`` and accumulates ``dKi`` (float32, zero-initialised) atomically."""
    n = T.dynamic("tokens")
    bk = _TOPK_BLOCK

    @T.prim_func
    def indexer_topk_logits_bwd_kernel(
        DLogits: T.Tensor((n, topk), "float32"),
        Qi: T.Tensor((n, heads, dim), dtype),
        Ki: T.Tensor((n, dim), dtype),
        W: T.Tensor((n, heads), dtype),
        Idx: T.Tensor((n, topk), "int32"),
        DQi: T.Tensor((n, heads, dim), dtype),
        DKi: T.Tensor((n, dim), "float32"),
        DW: T.Tensor((n, heads), dtype),
    ):
        with T.Kernel(n, threads=_TOPK_THREADS) as t:
            q_s = T.alloc_shared((heads, dim), dtype)
            k_s = T.alloc_shared((bk, dim), dtype)
            da_s = T.alloc_shared((heads, bk), dtype)
            idx = T.alloc_shared((bk,), "int32")
            g = T.alloc_shared((bk,), "float32")
            w = T.alloc_fragment((heads,), "float32")
            acc = T.alloc_fragment((heads, bk), "float32")
            relu_g = T.alloc_fragment((heads, bk), "float32")
            dw_blk = T.alloc_fragment((heads,), "float32")
            dw = T.alloc_fragment((heads,), "float32")
            acc_dq = T.alloc_fragment((heads, dim), "float32")
            acc_dk = T.alloc_fragment((bk, dim), "float32")
            T.copy(Qi[t, :, :], q_s)
            for h in T.Parallel(heads):
                w[h] = T.cast(W[t, h], "float32")
            T.clear(dw)
            T.clear(acc_dq)
            for kb in T.serial(topk // bk):
                for i in T.Parallel(bk):
                    idx[i] = Idx[t, kb * bk + i]
                    g[i] = T.if_then_else(Idx[t, kb * bk + i] >= 0, DLogits[t, kb * bk + i], 0)
                for i, d in T.Parallel(bk, dim):
                    k_s[i, d] = Ki[T.max(Idx[t, kb * bk + i], 0), d]
                T.clear(acc)
                T.gemm(q_s, k_s, acc, transpose_B=True)
                # logit = sum_h w_h relu(a_h): dw_h = sum_k g_k relu(a_hk), da_hk = g_k w_h [a_hk > 0]
                for h, i in T.Parallel(heads, bk):
                    relu_g[h, i] = T.max(acc[h, i], 0) * g[i]
                    acc[h, i] = T.if_then_else(acc[h, i] > 0, g[i] * w[h], 0)
                T.reduce_sum(relu_g, dw_blk, dim=1)
                for h in T.Parallel(heads):
                    dw[h] += dw_blk[h]
                T.copy(acc, da_s)
                T.gemm(da_s, k_s, acc_dq)
                T.clear(acc_dk)
                T.gemm(da_s, q_s, acc_dk, transpose_A=True)
                for i, d in T.Parallel(bk, dim):
                    if idx[i] >= 0:
                        T.atomic_add(DKi[idx[i], d], acc_dk[i, d])
            T.copy(acc_dq, DQi[t, :, :])
            for h in T.Parallel(heads):
                DW[t, h] = T.cast(dw[h], dtype)

    return compile_kernel(indexer_topk_logits_bwd_kernel, target)


def _pad_indices(indices: torch.Tensor) -> torch.Tensor:
    pad = -indices.shape[1] % _TOPK_BLOCK
    return torch.nn.functional.pad(indices, (0, pad), value=-1).contiguous() if pad else indices


def indexer_scores(q_i: torch.Tensor, k_i: torch.Tensor, w: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    n, heads, dim = q_i.shape
    out = torch.full((n, n), float("-inf"), dtype=torch.float32, device=q_i.device)
    build_scores(heads, dim, dtype_name(q_i.dtype))(q_i, k_i, w, starts.to(torch.int32).contiguous(), out)
    return out


def indexer_topk_logits_fwd(
    q_i: torch.Tensor, k_i: torch.Tensor, w: torch.Tensor, indices: torch.Tensor
) -> torch.Tensor:
    n, heads, dim = q_i.shape
    idx = _pad_indices(indices)
    logits = torch.empty(idx.shape, dtype=torch.float32, device=q_i.device)
    build_topk_logits_fwd(heads, dim, idx.shape[1], dtype_name(q_i.dtype))(q_i, k_i, w, idx, logits)
    return logits[:, : indices.shape[1]]


def indexer_topk_logits_bwd(
    dlogits: torch.Tensor, q_i: torch.Tensor, k_i: torch.Tensor, w: torch.Tensor, indices: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, heads, dim = q_i.shape
    idx = _pad_indices(indices)
    g = torch.nn.functional.pad(dlogits.float(), (0, idx.shape[1] - indices.shape[1])).contiguous()
    dq = torch.empty_like(q_i)
    dk = torch.zeros(k_i.shape, dtype=torch.float32, device=k_i.device)
    dw = torch.empty_like(w)
    build_topk_logits_bwd(heads, dim, idx.shape[1], dtype_name(q_i.dtype))(g, q_i, k_i, w, idx, dq, dk, dw)
    return dq, dk.to(k_i.dtype), dw


def indexer_topk(q_i: torch.Tensor, k_i: torch.Tensor, w: torch.Tensor, starts: torch.Tensor, topk: int) -> torch.Tensor:
    """The TileLang scores, then ``torch.topk`` (as the reference selects)."""
    from loong_kernels.reference.dsa import topk_indices

    return topk_indices(indexer_scores(q_i, k_i, w, starts), topk)
