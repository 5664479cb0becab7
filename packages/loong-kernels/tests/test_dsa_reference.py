"""DeepSeek Sparse Attention references against direct dense formulas, and their backward."""

import pytest
import torch

from loong_kernels import (
    deepseek_sparse_attention,
    indexer_kl_loss,
    lightning_indexer_scores,
    lightning_indexer_topk,
    lightning_indexer_topk_at,
    select_topk,
    sparse_attention_head_mean_probs,
    sparse_mla_attention,
)
from loong_kernels.ops.dsa import IndexerKLLossFunction, SparseMLAFunction
from loong_kernels.reference import dsa as ref

CU = torch.tensor([0, 5, 12, 16])  # three packed documents


def _allowed(n, cu):
    """Dense [T, T] mask: causal within each document."""
    starts = ref.doc_starts(cu, n, torch.device("cpu")).long()
    t = torch.arange(n)
    return (t[None, :] <= t[:, None]) & (t[None, :] >= starts[:, None])


def _rand(*shape, seed, dtype=torch.float64):
    return torch.randn(*shape, dtype=dtype, generator=torch.Generator().manual_seed(seed))


def test_doc_starts_and_validation():
    assert ref.doc_starts(CU, 16, torch.device("cpu")).tolist() == [0] * 5 + [5] * 7 + [12] * 4
    assert ref.doc_starts(None, 3, torch.device("cpu")).tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match="cu_seqlens"):
        ref.doc_starts(torch.tensor([0, 4]), 5, torch.device("cpu"))


def test_indexer_scores_match_einsum():
    n, h, d = 16, 3, 4
    q_i, k_i, w = _rand(n, h, d, seed=0), _rand(n, d, seed=1), _rand(n, h, seed=2)
    got = lightning_indexer_scores(q_i, k_i, w, CU)
    want = torch.einsum("th,ths->ts", w, torch.relu(torch.einsum("thd,sd->ths", q_i, k_i)))
    allowed = _allowed(n, CU)
    torch.testing.assert_close(got[allowed], want[allowed])
    assert torch.isneginf(got[~allowed]).all()


def test_topk_selects_best_allowed_keys_and_pads():
    n = 16
    scores = lightning_indexer_scores(_rand(n, 2, 4, seed=3), _rand(n, 4, seed=4), _rand(n, 2, seed=5), CU)
    idx = select_topk(scores, 3)
    assert idx.dtype == torch.int32 and idx.shape == (n, 3)
    allowed = _allowed(n, CU)
    for t in range(n):
        chosen = sorted(i for i in idx[t].tolist() if i >= 0)
        n_allowed = int(allowed[t].sum())
        assert len(chosen) == min(3, n_allowed)
        best = scores[t].topk(len(chosen)).indices.tolist()
        assert chosen == sorted(best)
    wide = select_topk(scores, 20)  # more than the sequence: padded with -1
    assert wide.shape == (n, 20) and (wide[:, 16:] == -1).all()


def test_some_queries_against_all_keys_select_what_the_square_selection_selects_for_them():
    """A context-parallel rank's queries (rows 2-3 and 12-13 of one packed batch) against every key."""
    n = 16
    q_i, k_i, w = _rand(n, 2, 4, seed=6), _rand(n, 4, seed=7), _rand(n, 2, seed=8)
    rows = torch.tensor([2, 3, 12, 13])
    starts = ref.doc_starts(CU, n, torch.device("cpu"))
    square = lightning_indexer_topk(q_i, k_i, w, 3, CU)[rows]
    part = lightning_indexer_topk_at(q_i[rows], k_i, w[rows], 3, rows, starts[rows])
    assert part.shape == (4, 3) and part.dtype == torch.int32
    assert part.sort(-1).values.tolist() == square.sort(-1).values.tolist()
    assert sorted(part[2].tolist()) == [-1, -1, 12]  # the first token of its document sees itself only


def _dense_attention(q, kv, mask, d_v, scale):
    s = torch.einsum("thd,sd->ths", q, kv) * scale
    s = s.masked_fill(~mask[:, None, :], float("-inf"))
    return torch.einsum("ths,sv->thv", torch.softmax(s, -1), kv[:, :d_v]), torch.logsumexp(s, -1)


def test_sparse_attention_with_all_keys_equals_dense_causal_attention():
    n, h, d_qk, d_v = 16, 4, 12, 8
    q, kv = _rand(n, h, d_qk, seed=6), _rand(n, d_qk, seed=7)
    allowed = _allowed(n, CU)
    scores = torch.where(allowed, 0.0, float("-inf"))
    idx = select_topk(scores, n)  # top-k = every allowed key
    out, lse = sparse_mla_attention(q, kv, idx, d_v=d_v)
    want, want_lse = _dense_attention(q, kv, allowed, d_v, d_qk**-0.5)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse)


def _random_indices(n, k, cu, seed):
    """Random distinct allowed keys per query, -1 padded, in shuffled slot order."""
    g = torch.Generator().manual_seed(seed)
    allowed = _allowed(n, cu)
    idx = torch.full((n, k), -1, dtype=torch.int32)
    for t in range(n):
        keys = allowed[t].nonzero().flatten()
        keys = keys[torch.randperm(len(keys), generator=g)][:k]
        slots = torch.randperm(k, generator=g)[: len(keys)]
        idx[t, slots] = keys.int()
    return idx


def test_sparse_attention_subset_values_and_grads_match_masked_dense():
    n, h, d_qk, d_v, k = 16, 2, 10, 6, 3
    q = _rand(n, h, d_qk, seed=8).requires_grad_()
    kv = _rand(n, d_qk, seed=9).requires_grad_()
    idx = _random_indices(n, k, CU, seed=10)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for t in range(n):
        mask[t, idx[t][idx[t] >= 0].long()] = True
    out, lse = sparse_mla_attention(q, kv, idx, d_v=d_v, scale=0.3)
    want, want_lse = _dense_attention(q, kv, mask, d_v, 0.3)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse)
    dout = _rand(n, h, d_v, seed=11)
    got = torch.autograd.grad(out, [q, kv], dout)
    exp = torch.autograd.grad(want, [q, kv], dout)
    for g, e in zip(got, exp):
        torch.testing.assert_close(g, e)


def test_sparse_attention_gradcheck():
    n, h, d_qk, d_v = 6, 2, 5, 3
    q = _rand(n, h, d_qk, seed=12).requires_grad_()
    kv = _rand(n, d_qk, seed=13).requires_grad_()
    idx = _random_indices(n, 4, torch.tensor([0, 6]), seed=14)
    assert torch.autograd.gradcheck(lambda a, b: SparseMLAFunction.apply(a, b, idx, d_v, 0.5)[0], (q, kv))


def test_query_without_keys_gets_zero_output():
    q, kv = _rand(2, 1, 4, seed=15), _rand(2, 4, seed=16)
    idx = torch.tensor([[-1, -1], [0, 1]], dtype=torch.int32)
    out, lse = sparse_mla_attention(q, kv, idx, d_v=4)
    assert out[0].abs().max() == 0 and torch.isneginf(lse[0]).all()


def test_head_mean_probs_are_the_averaged_softmax():
    n, h, d_qk, k = 16, 3, 6, 4
    q, kv = _rand(n, h, d_qk, seed=17), _rand(n, d_qk, seed=18)
    idx = _random_indices(n, k, CU, seed=19)
    _, lse = sparse_mla_attention(q, kv, idx, d_v=4)
    p = sparse_attention_head_mean_probs(q, kv, idx, lse)
    valid = idx >= 0
    s = torch.einsum("thd,tkd->thk", q, kv[idx.clamp(min=0).long()]) * d_qk**-0.5
    want = torch.softmax(s.masked_fill(~valid[:, None], float("-inf")), -1).mean(1)
    torch.testing.assert_close(p, want)
    torch.testing.assert_close(p.sum(-1), torch.ones(n, dtype=torch.float64))


def _direct_kl(q_i, k_i, w, idx, target):
    valid = idx >= 0
    logits = torch.einsum("th,thk->tk", w, torch.relu(torch.einsum("thd,tkd->thk", q_i, k_i[idx.clamp(min=0).long()])))
    logq = torch.log_softmax(logits.masked_fill(~valid, float("-inf")), -1)
    p = target
    return torch.where(valid & (p > 0), p * (torch.log(p) - logq), 0.0).sum(-1).mean()


def test_indexer_kl_loss_matches_direct_formula_values_and_grads():
    n, h, d, k = 16, 3, 5, 4
    q_i = _rand(n, h, d, seed=20).requires_grad_()
    k_i = _rand(n, d, seed=21).requires_grad_()
    w = _rand(n, h, seed=22).requires_grad_()
    idx = _random_indices(n, k, CU, seed=23)
    raw = torch.rand(n, k, dtype=torch.float64, generator=torch.Generator().manual_seed(24)) * (idx >= 0)
    target = raw / raw.sum(-1, keepdim=True)
    loss = indexer_kl_loss(q_i, k_i, w, idx, target)
    want = _direct_kl(q_i, k_i, w, idx, target)
    torch.testing.assert_close(loss, want)
    for g, e in zip(torch.autograd.grad(loss, [q_i, k_i, w]), torch.autograd.grad(want, [q_i, k_i, w])):
        torch.testing.assert_close(g, e)


def test_indexer_kl_loss_gradcheck():
    n, h, d = 6, 2, 3
    q_i = _rand(n, h, d, seed=25).requires_grad_()
    k_i = _rand(n, d, seed=26).requires_grad_()
    w = _rand(n, h, seed=27).requires_grad_()
    idx = _random_indices(n, 3, torch.tensor([0, 6]), seed=28)
    raw = torch.rand(n, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(29)) * (idx >= 0)
    target = raw / raw.sum(-1, keepdim=True)
    assert torch.autograd.gradcheck(lambda a, b, c: IndexerKLLossFunction.apply(a, b, c, idx, target), (q_i, k_i, w))


def test_pipeline_keeps_indexer_and_attention_gradients_apart():
    n, h, d_qk, d_v, h_i, d_i = 16, 2, 12, 8, 2, 4
    q = _rand(n, h, d_qk, seed=30).requires_grad_()
    kv = _rand(n, d_qk, seed=31).requires_grad_()
    q_i = _rand(n, h_i, d_i, seed=32).requires_grad_()
    k_i = _rand(n, d_i, seed=33).requires_grad_()
    w = _rand(n, h_i, seed=34).requires_grad_()
    res = deepseek_sparse_attention(q, kv, q_i, k_i, w, topk=4, cu_seqlens=CU, d_v=d_v)
    assert res.out.shape == (n, h, d_v) and res.indices.shape == (n, 4)
    g_attn = torch.autograd.grad(res.out.sum(), [q, kv, q_i, k_i, w], allow_unused=True)
    assert g_attn[0] is not None and g_attn[1] is not None
    assert all(g is None for g in g_attn[2:]), "attention output must not train the indexer"
    g_idx = torch.autograd.grad(res.indexer_loss, [q, kv, q_i, k_i, w], allow_unused=True)
    assert g_idx[0] is None and g_idx[1] is None, "indexer loss must not reach the attention inputs"
    assert all(g is not None and g.abs().sum() > 0 for g in g_idx[2:])
    assert res.indexer_loss.item() >= 0
