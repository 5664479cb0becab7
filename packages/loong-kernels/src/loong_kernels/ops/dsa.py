"""DeepSeek Sparse Attention: public functions and their autograd Functions.

The pieces, in the order a DeepSeek-V3.2 attention layer uses them:

1. :func:`lightning_indexer_scores` then :func:`select_topk` pick ``topk`` keys per query
   (no gradient: selection is discrete); :func:`lightning_indexer_topk` does both in one op;
2. :func:`sparse_mla_attention` attends over those keys only (gradients to ``q`` and ``kv``);
3. :func:`indexer_kl_loss` trains the indexer towards the head-averaged attention distribution
   over the same keys (:func:`sparse_attention_head_mean_probs`, detached): it is the indexer's
   only source of gradient. To keep the indexer's loss out of the main model, the caller feeds
   the indexer projections detached hidden states, as DeepSeek-V3.2 does.

:func:`deepseek_sparse_attention` runs all three.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from loong_kernels.dispatch import call, call_with, choose_op
from loong_kernels.reference import dsa as ref


class SparseMLAFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, d_v: int, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # measured once per shape bucket; the backward runs the same implementation (LSE conventions differ)
        impl = choose_op("sparse_mla", q, kv, indices, d_v, scale)
        out, lse = call_with(impl, "sparse_mla_fwd", q, kv, indices, d_v, scale)
        ctx.save_for_backward(q, kv, out, indices, lse)
        ctx.d_v, ctx.scale, ctx.impl = d_v, scale, impl
        # the LSE is returned for inspection and the indexer target, not differentiated
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor, _dlse: torch.Tensor | None) -> tuple[Any, ...]:
        q, kv, out, indices, lse = ctx.saved_tensors
        dq, dkv = call_with(ctx.impl, "sparse_mla_bwd", q, kv, out, dout.contiguous(), indices, lse, ctx.d_v, ctx.scale)
        return dq, dkv, None, None, None


class IndexerKLLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, q_i: torch.Tensor, k_i: torch.Tensor, w: torch.Tensor, indices: torch.Tensor, target: torch.Tensor
    ) -> torch.Tensor:
        logits = call("indexer_topk_logits_fwd", q_i, k_i, w, indices)
        ctx.save_for_backward(q_i, k_i, w, indices, logits, target)
        return ref.indexer_kl_loss_from_logits(logits, target)

    @staticmethod
    def backward(ctx: Any, dloss: torch.Tensor) -> tuple[Any, ...]:
        q_i, k_i, w, indices, logits, target = ctx.saved_tensors
        dlogits = ref.indexer_kl_grad_logits(logits, target) * dloss
        dq_i, dk_i, dw = call("indexer_topk_logits_bwd", dlogits.contiguous(), q_i, k_i, w, indices)
        return dq_i, dk_i, dw, None, None


def _check_thd(name: str, x: torch.Tensor, ndim: int) -> None:
    if x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims (packed THD layout, no batch dim), got {tuple(x.shape)}")


@torch.no_grad()
def lightning_indexer_scores(
    q_i: torch.Tensor, k_i: torch.Tensor, w: torch.Tensor, cu_seqlens: torch.Tensor | None = None
) -> torch.Tensor:
    """``I[t, s] = sum_h w[t, h] * relu(q_i[t, h] . k_i[s])`` for ``start(t) <= s <= t``, else ``-inf``.

    ``q_i``: ``[T, H_i, D_i]``, ``k_i``: ``[T, D_i]``, ``w``: ``[T, H_i]``; ``cu_seqlens``
    (int, ``[docs + 1]``) gives the document boundaries of packed input (None: one document).
    Returns float32 ``[T, T]``; no gradient (it only serves the top-k selection).
    """
    _check_thd("q_i", q_i, 3)
    _check_thd("k_i", k_i, 2)
    starts = ref.doc_starts(cu_seqlens, q_i.shape[0], q_i.device)
    return call("indexer_scores", q_i.contiguous(), k_i.contiguous(), w.contiguous(), starts)


@torch.no_grad()
def lightning_indexer_topk(
    q_i: torch.Tensor, k_i: torch.Tensor, w: torch.Tensor, topk: int, cu_seqlens: torch.Tensor | None = None
) -> torch.Tensor:
    """``select_topk(lightning_indexer_scores(...), topk)`` as one op, so that implementations that
    fuse the two (megatron-core's) can be chosen: the dispatcher measures which is fastest per shape."""
    _check_thd("q_i", q_i, 3)
    _check_thd("k_i", k_i, 2)
    starts = ref.doc_starts(cu_seqlens, q_i.shape[0], q_i.device)
    args = (q_i.contiguous(), k_i.contiguous(), w.contiguous(), starts, topk)
    return call_with(choose_op("indexer_topk", *args), "indexer_topk", *args)


@torch.no_grad()
def lightning_indexer_topk_at(
    q_i: torch.Tensor, k_i: torch.Tensor, w: torch.Tensor, topk: int, rows: torch.Tensor, starts: torch.Tensor
) -> torch.Tensor:
    """:func:`lightning_indexer_topk` for queries that are some of the keys: query ``t`` is key
    ``rows[t]`` and sees keys ``starts[t] .. rows[t]`` (a context-parallel rank's queries against
    the whole sequence's gathered keys). ``q_i`` ``[T, H_i, D_i]``, ``k_i`` ``[S, D_i]``, ``w``
    ``[T, H_i]``; returns int32 ``[T, topk]`` indices into ``k_i``, ``-1`` for empty slots.

    The torch reference runs it on every device: the fused kernels score square ``[T, T]`` blocks."""
    _check_thd("q_i", q_i, 3)
    _check_thd("k_i", k_i, 2)
    return ref.indexer_topk(q_i.contiguous(), k_i.contiguous(), w.contiguous(), starts.to(q_i.device), topk, rows)


def select_topk(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """int32 ``[T, topk]`` indices of the best keys per query; ``-1`` where fewer keys are allowed."""
    return ref.topk_indices(scores, topk)


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return q.shape[-1] ** -0.5 if scale is None else scale


def sparse_mla_attention(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, d_v: int = 512, scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query attends over its selected keys only; returns ``(out [T, H, d_v], lse [T, H])``.

    MQA layout of absorbed MLA: ``q`` ``[T, H, d_qk]``, one shared latent head ``kv`` ``[T, d_qk]``
    (keys are all ``d_qk`` dims, values the first ``d_v``), ``indices`` int ``[T, K]`` with ``-1``
    for empty slots. ``scale`` defaults to ``d_qk ** -0.5``; ``lse`` (float32, natural log) is not
    differentiable.
    """
    _check_thd("q", q, 3)
    _check_thd("kv", kv, 2)
    if not 0 < d_v <= kv.shape[-1]:
        raise ValueError(f"d_v={d_v} must be in (0, {kv.shape[-1]}]")
    return SparseMLAFunction.apply(
        q.contiguous(), kv.contiguous(), indices.to(torch.int32).contiguous(), d_v, _scale(q, scale)
    )


@torch.no_grad()
def sparse_attention_head_mean_probs(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, lse: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """float32 ``[T, K]``: attention probability of each selected key, averaged over the heads.

    The indexer's training target; rows sum to 1, empty slots are 0. No gradient.
    """
    return call(
        "sparse_attention_head_mean_probs",
        q.contiguous(),
        kv.contiguous(),
        indices.to(torch.int32).contiguous(),
        lse.contiguous(),
        _scale(q, scale),
    )


def indexer_kl_loss(
    q_i: torch.Tensor, k_i: torch.Tensor, w: torch.Tensor, indices: torch.Tensor, target: torch.Tensor
) -> torch.Tensor:
    """``mean_t KL(target[t] || softmax_k(I[t, indices[t, k]]))`` over the selected keys.

    Gradients flow to ``q_i``, ``k_i`` and ``w`` only; ``target`` (see
    :func:`sparse_attention_head_mean_probs`) is treated as a constant.
    """
    return IndexerKLLossFunction.apply(
        q_i.contiguous(), k_i.contiguous(), w.contiguous(), indices.to(torch.int32).contiguous(), target.detach()
    )


class DSAOutput(NamedTuple):
    out: torch.Tensor
    lse: torch.Tensor
    indices: torch.Tensor
    indexer_loss: torch.Tensor


def deepseek_sparse_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    q_i: torch.Tensor,
    k_i: torch.Tensor,
    w: torch.Tensor,
    topk: int,
    cu_seqlens: torch.Tensor | None = None,
    d_v: int = 512,
    scale: float | None = None,
) -> DSAOutput:
    """Indexer -> top-k -> sparse MLA attention -> indexer KL loss, for packed THD input.

    Add ``indexer_loss`` (times its coefficient) to the training loss: it is the indexer's
    only gradient, and it does not reach ``q`` or ``kv``.
    """
    indices = lightning_indexer_topk(q_i, k_i, w, topk, cu_seqlens)
    out, lse = sparse_mla_attention(q, kv, indices, d_v, scale)
    target = sparse_attention_head_mean_probs(q.detach(), kv.detach(), indices, lse, scale)
    loss = indexer_kl_loss(q_i, k_i, w, indices, target)
    return DSAOutput(out, lse, indices, loss)
