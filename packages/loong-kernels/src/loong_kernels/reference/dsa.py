"""DeepSeek Sparse Attention (DSA, DeepSeek-V3.2) in plain torch: the definitions the kernels match.

Layout is packed THD without a batch dim: ``T`` tokens of one or more documents back to back,
document boundaries given by ``cu_seqlens`` (as in flash-attention's varlen API).

* lightning indexer: ``I[t, s] = sum_h w[t, h] * relu(q_i[t, h] . k_i[s])`` for
  ``start(t) <= s <= t`` (causal, within the document), ``-inf`` elsewhere;
* sparse MLA attention in the absorbed MQA layout: one latent KV head ``kv[s]`` of width
  ``d_qk`` (e.g. 512 latent + 64 rope) shared by all query heads; values are ``kv[s, :d_v]``;
  each query attends only to its ``indices[t]`` (``-1`` marks an empty slot);
* the indexer's loss works on the selected keys only (see :func:`indexer_topk_logits_fwd`).

Everything is computed in float32 (float64 for float64 input, for gradcheck) and in chunks of queries so that the gathered keys of one
chunk, not of the whole sequence, are alive at once.
"""

from __future__ import annotations

import torch

from loong_kernels.reference._precision import acc, acc_dtype

# Elements of the largest float32 temporary one chunk may create (~512 MiB).
_CHUNK_ELEMENTS = 2**27


def _query_chunk(per_query: int) -> int:
    return max(1, _CHUNK_ELEMENTS // max(per_query, 1))


def doc_starts(cu_seqlens: torch.Tensor | None, n_tokens: int, device: torch.device) -> torch.Tensor:
    """``starts[t]``: index of the first token of ``t``'s document (int32, ``[T]``)."""
    pos = torch.arange(n_tokens, device=device, dtype=torch.int64)
    if cu_seqlens is None:
        return torch.zeros(n_tokens, dtype=torch.int32, device=device)
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    if int(cu[0]) != 0 or int(cu[-1]) != n_tokens:
        raise ValueError(f"cu_seqlens must start at 0 and end at the token count {n_tokens}, got {cu.tolist()}")
    doc = torch.bucketize(pos, cu[1:], right=True)
    return cu[doc].to(torch.int32)


def indexer_scores(
    q_i: torch.Tensor, k_i: torch.Tensor, w: torch.Tensor, starts: torch.Tensor, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """Lightning-indexer scores ``[T, S]`` float32, ``-inf`` outside each query's causal document.

    ``q_i``: ``[T, H_i, D_i]``, ``k_i``: ``[S, D_i]``, ``w``: ``[T, H_i]``, ``starts``: :func:`doc_starts`
    of each query. ``rows``: each query's own index among the keys (None: query ``t`` is key ``t``,
    ``S == T``); a context-parallel rank scores its queries against the whole sequence's keys.
    """
    n, heads, _ = q_i.shape
    kf = acc(k_i)
    keys = torch.arange(k_i.shape[0], device=q_i.device)
    rows = keys[:n] if rows is None else rows.to(device=q_i.device, dtype=torch.int64)
    out = torch.empty(n, k_i.shape[0], dtype=acc_dtype(q_i), device=q_i.device)
    step = _query_chunk(heads * k_i.shape[0])
    for c0 in range(0, n, step):
        q = acc(q_i[c0 : c0 + step])
        s = torch.relu(torch.einsum("thd,sd->ths", q, kf))
        scores = torch.einsum("ths,th->ts", s, acc(w[c0 : c0 + step]))
        row = rows[c0 : c0 + step, None]
        allowed = (keys[None, :] <= row) & (keys[None, :] >= starts[c0 : c0 + step, None].long())
        out[c0 : c0 + step] = scores.masked_fill(~allowed, float("-inf"))
    return out


def topk_indices(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """The ``topk`` best keys of each query (int32 ``[T, topk]``), ``-1`` where fewer are allowed.

    Not a kernel: ``torch.topk`` is used on every device.
    """
    n = scores.shape[1]
    k = min(topk, n)
    values, idx = scores.topk(k, dim=-1, sorted=False)
    idx = torch.where(torch.isinf(values), -1, idx).to(torch.int32)
    if k < topk:
        idx = torch.nn.functional.pad(idx, (0, topk - k), value=-1)
    return idx


def indexer_topk(
    q_i: torch.Tensor, k_i: torch.Tensor, w: torch.Tensor, starts: torch.Tensor, topk: int,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`topk_indices` of :func:`indexer_scores`: the selection as one kernel-shaped call."""
    return topk_indices(indexer_scores(q_i, k_i, w, starts, rows), topk)


def _gather_rows(x: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x[indices]`` in float32 with empty slots (``-1``) reading row 0, and the validity mask."""
    valid = indices >= 0
    return acc(x[indices.clamp(min=0).long()]), valid


def sparse_mla_fwd(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, d_v: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse attention over the selected keys: ``(out [T, H, d_v], lse [T, H] float32)``.

    ``q``: ``[T, H, d_qk]``, ``kv``: ``[T, d_qk]``, ``indices``: ``[T, K]`` int (``-1`` = empty).
    ``lse`` is the natural-log sum of ``exp(scale * q . k)`` over the selected keys. A query
    with no selected key gets ``out = 0`` and ``lse = -inf``.
    """
    n, heads, d_qk = q.shape
    out = torch.empty(n, heads, d_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(n, heads, dtype=acc_dtype(q), device=q.device)
    step = _query_chunk(indices.shape[1] * (d_qk + heads))
    for c0 in range(0, n, step):
        k, valid = _gather_rows(kv, indices[c0 : c0 + step])
        s = torch.einsum("thd,tkd->thk", acc(q[c0 : c0 + step]), k) * scale
        s = s.masked_fill(~valid[:, None, :], float("-inf"))
        m = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - torch.where(torch.isinf(m), 0.0, m)[..., None])
        out[c0 : c0 + step] = torch.einsum("thk,tkv->thv", p, k[..., :d_v]).to(q.dtype)
        lse[c0 : c0 + step] = m
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
    """Gradients ``(dq, dkv)`` of :func:`sparse_mla_fwd`'s ``out`` (``lse`` is not differentiated)."""
    n, heads, d_qk = q.shape
    dq = torch.empty_like(q)
    dkv = torch.zeros(kv.shape, dtype=acc_dtype(kv), device=kv.device)
    # delta[t, h] = sum_v dout * out: the softmax backward's row term, computed once
    delta = (acc(dout) * acc(out)).sum(-1)
    step = _query_chunk(indices.shape[1] * (d_qk + heads))
    for c0 in range(0, n, step):
        idx = indices[c0 : c0 + step]
        k, valid = _gather_rows(kv, idx)
        qc, do = acc(q[c0 : c0 + step]), acc(dout[c0 : c0 + step])
        m = lse[c0 : c0 + step]
        s = torch.einsum("thd,tkd->thk", qc, k) * scale
        p = torch.exp(s - torch.where(torch.isinf(m), 0.0, m)[..., None])
        p = p.masked_fill(~valid[:, None, :], 0.0)
        dp = torch.einsum("thv,tkv->thk", do, k[..., :d_v])
        ds = p * (dp - delta[c0 : c0 + step, :, None]) * scale
        dq[c0 : c0 + step] = torch.einsum("thk,tkd->thd", ds, k).to(q.dtype)
        dk = torch.einsum("thk,thd->tkd", ds, qc)
        dk[..., :d_v] += torch.einsum("thk,thv->tkv", p, do)
        dkv.index_add_(0, idx.clamp(min=0).long().flatten(), (dk * valid[..., None]).flatten(0, 1))
    return dq, dkv.to(kv.dtype)


def sparse_attention_head_mean_probs(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, lse: torch.Tensor, scale: float
) -> torch.Tensor:
    """``[T, K]`` float32: the attention probabilities of each selected key, averaged over heads.

    This is the indexer's training target; empty slots get 0. Each row sums to 1.
    """
    n, heads, d_qk = q.shape
    probs = torch.empty(indices.shape, dtype=acc_dtype(q), device=q.device)
    step = _query_chunk(indices.shape[1] * (d_qk + heads))
    for c0 in range(0, n, step):
        k, valid = _gather_rows(kv, indices[c0 : c0 + step])
        m = lse[c0 : c0 + step]
        s = torch.einsum("thd,tkd->thk", acc(q[c0 : c0 + step]), k) * scale
        p = torch.exp(s - torch.where(torch.isinf(m), 0.0, m)[..., None])
        probs[c0 : c0 + step] = p.masked_fill(~valid[:, None, :], 0.0).mean(1)
    return probs


def indexer_topk_logits_fwd(
    q_i: torch.Tensor, k_i: torch.Tensor, w: torch.Tensor, indices: torch.Tensor
) -> torch.Tensor:
    """Indexer scores of the selected keys only: ``[T, K]`` float32, ``-inf`` at empty slots."""
    n, heads, d_i = q_i.shape
    logits = torch.empty(indices.shape, dtype=acc_dtype(q_i), device=q_i.device)
    step = _query_chunk(indices.shape[1] * (d_i + heads))
    for c0 in range(0, n, step):
        k, valid = _gather_rows(k_i, indices[c0 : c0 + step])
        a = torch.relu(torch.einsum("thd,tkd->thk", acc(q_i[c0 : c0 + step]), k))
        x = torch.einsum("thk,th->tk", a, acc(w[c0 : c0 + step]))
        logits[c0 : c0 + step] = x.masked_fill(~valid, float("-inf"))
    return logits


def indexer_topk_logits_bwd(
    dlogits: torch.Tensor, q_i: torch.Tensor, k_i: torch.Tensor, w: torch.Tensor, indices: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq_i, dk_i, dw)`` of :func:`indexer_topk_logits_fwd` given ``dlogits [T, K]``."""
    n, heads, d_i = q_i.shape
    dq = torch.empty_like(q_i)
    dw = torch.empty_like(w)
    dk = torch.zeros(k_i.shape, dtype=acc_dtype(k_i), device=k_i.device)
    step = _query_chunk(indices.shape[1] * (d_i + heads))
    for c0 in range(0, n, step):
        idx = indices[c0 : c0 + step]
        k, valid = _gather_rows(k_i, idx)
        qc, wc = acc(q_i[c0 : c0 + step]), acc(w[c0 : c0 + step])
        g = (acc(dlogits[c0 : c0 + step]) * valid).nan_to_num(0.0)
        a = torch.einsum("thd,tkd->thk", qc, k)
        dw[c0 : c0 + step] = torch.einsum("tk,thk->th", g, torch.relu(a)).to(w.dtype)
        da = g[:, None, :] * wc[..., None] * (a > 0)
        dq[c0 : c0 + step] = torch.einsum("thk,tkd->thd", da, k).to(q_i.dtype)
        dk.index_add_(0, idx.clamp(min=0).long().flatten(), torch.einsum("thk,thd->tkd", da, qc).flatten(0, 1))
    return dq, dk.to(k_i.dtype), dw


def indexer_kl_loss_from_logits(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``mean_t KL(target[t] || softmax(logits[t]))`` over the selected keys (``-inf`` = empty)."""
    logq = torch.log_softmax(logits, dim=-1)
    kl = torch.xlogy(target, target) - torch.where(target > 0, target * logq, 0.0)
    return kl.sum(-1).mean()


def indexer_kl_grad_logits(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """d :func:`indexer_kl_loss_from_logits` / d logits (0 at empty slots)."""
    q = torch.softmax(logits, dim=-1)
    # d/dl_k of -sum_j p_j log q_j is q_k * sum_j p_j - p_k (sum p is 1 up to rounding)
    g = q * target.sum(-1, keepdim=True) - target
    return (g / logits.shape[0]).nan_to_num(0.0)
