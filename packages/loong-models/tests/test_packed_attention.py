"""Packed (THD) sequences on the local layer spec: no attention across documents, positions
restart per document, and the loss equals training each document on its own (fp32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loong_models import build_model, build_transformer_config, load_model_config, packed_seq_params
from loong_models.attention.packed import packed_causal_attention

DOC_LENGTHS = [5, 11, 3, 8]


def _block_causal_reference(q, k, v, lengths, scale):
    """Full [t, t] block-diagonal causal mask, only for checking."""
    t = q.shape[0]
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.arange(t)
    allowed = (doc[:, None] == doc[None, :]) & (pos[:, None] >= pos[None, :])
    out = F.scaled_dot_product_attention(
        *(x.transpose(0, 1) for x in (q, k, v)),
        attn_mask=allowed,
        scale=scale,
        enable_gqa=k.shape[1] != q.shape[1],
    )
    return out.transpose(0, 1).reshape(t, -1)


@pytest.mark.parametrize("groups", [4, 2], ids=["mha", "gqa"])
def test_packed_attention_equals_block_diagonal_causal_mask(groups: int) -> None:
    torch.manual_seed(0)
    t = sum(DOC_LENGTHS)
    q = torch.randn(t, 4, 16, dtype=torch.float64)
    k, v = torch.randn(2, t, groups, 16, dtype=torch.float64)
    cu = torch.tensor([0, 5, 16, 19, 27], dtype=torch.int32)
    out = packed_causal_attention(q, k, v, cu, scale=0.25)
    torch.testing.assert_close(
        out, _block_causal_reference(q, k, v, DOC_LENGTHS, 0.25), rtol=1e-12, atol=1e-12
    )
    # Changing a later document never changes an earlier one's output.
    k2 = k.clone()
    k2[5:] += 1.0
    assert torch.equal(packed_causal_attention(q, k2, v, cu, scale=0.25)[:5], out[:5])


@pytest.fixture(scope="module")
def tiny_model(megatron_cpu):
    cfg = load_model_config(
        "tiny",
        [
            "foundation.num_layers=2",
            "foundation.hidden_size=64",
            "foundation.ffn_hidden_size=128",
            "foundation.kv_channels=16",
            "foundation.num_query_groups=2",
            "layer_backend=local",
        ],
    )
    tconfig = build_transformer_config(
        cfg.foundation, params_dtype=torch.float32, use_cpu_initialization=True, calculate_per_token_loss=True
    )
    model = build_model(cfg, tconfig, device_type="cpu")
    return model, cfg.foundation.vocab_size


def _pack(docs: list[torch.Tensor], pad: int = 0):
    tokens = torch.cat([d[:-1] for d in docs] + [torch.zeros(pad, dtype=torch.long)])
    labels = torch.cat([d[1:] for d in docs] + [torch.zeros(pad, dtype=torch.long)])
    lengths = [len(d) - 1 for d in docs] + ([pad] if pad else [])
    position_ids = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return tokens[None], labels[None], position_ids[None], packed_seq_params(cu, max(lengths))


def test_packed_forward_and_loss_equal_per_document_forward(tiny_model) -> None:
    model, vocab = tiny_model
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(2, vocab, (n + 1,), generator=g) for n in DOC_LENGTHS]
    tokens, labels, position_ids, params = _pack(docs, pad=6)
    real = sum(DOC_LENGTHS)

    model.zero_grad()
    packed_loss = model(tokens, position_ids, None, labels=labels, packed_seq_params=params)
    assert packed_loss.shape == (1, real + 6)
    packed_loss[:, :real].sum().backward()
    packed_grad = model.embedding.word_embeddings.weight.grad.clone()

    model.zero_grad()
    single = []
    for d in docs:
        loss = model(d[None, :-1], torch.arange(len(d) - 1)[None], None, labels=d[None, 1:])
        loss.sum().backward()
        single.append(loss)
    single_loss = torch.cat(single, dim=1)
    torch.testing.assert_close(packed_loss[:, :real], single_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed_grad, model.embedding.word_embeddings.weight.grad, rtol=1e-4, atol=1e-5)

    with torch.no_grad():
        logits = model(tokens, position_ids, None, packed_seq_params=params)
        first = model(docs[0][None, :-1], torch.arange(DOC_LENGTHS[0])[None], None)
    torch.testing.assert_close(logits[:, : DOC_LENGTHS[0]], first, rtol=1e-5, atol=1e-5)


def test_packed_logits_of_a_document_ignore_its_neighbours(tiny_model) -> None:
    model, vocab = tiny_model
    g = torch.Generator().manual_seed(2)
    docs = [torch.randint(2, vocab, (n + 1,), generator=g) for n in DOC_LENGTHS]
    other = [docs[0], torch.randint(2, vocab, (DOC_LENGTHS[1] + 1,), generator=g), *docs[2:]]
    with torch.no_grad():
        tokens, _, position_ids, params = _pack(docs)
        a = model(tokens, position_ids, None, packed_seq_params=params)
        tokens, _, position_ids, params = _pack(other)
        b = model(tokens, position_ids, None, packed_seq_params=params)
    lo, hi = DOC_LENGTHS[0], DOC_LENGTHS[0] + DOC_LENGTHS[1]
    torch.testing.assert_close(a[:, :lo], b[:, :lo], rtol=0, atol=0)
    torch.testing.assert_close(a[:, hi:], b[:, hi:], rtol=1e-6, atol=1e-6)


def test_segment_groups_are_computed_once_per_micro_batch_and_give_the_same_attention() -> None:
    """Every layer of a block gets the same packed parameters: the grouping of segments by length
    (~200 windows per Qwen2.5-VL micro-batch) is computed by the first and reused by the rest."""
    from loong_models.packed_seq import host_segment_groups, segments_by_length

    torch.manual_seed(0)
    bounds = [0, 4, 8, 11, 15, 15, 18]  # lengths 4, 4, 3, 4, (empty), 3: two groups, not in order
    params = packed_seq_params(torch.tensor(bounds, dtype=torch.int32), 4, bounds=bounds)
    groups = host_segment_groups(params)
    assert groups == segments_by_length(bounds) == {4: [0, 4, 11], 3: [8, 15]}
    assert host_segment_groups(params) is groups  # cached on the parameters
    params.bounds = (0, 18)  # other bounds: grouped anew
    assert host_segment_groups(params) == {18: [0]}
    assert host_segment_groups(packed_seq_params(torch.tensor(bounds, dtype=torch.int32), 4)) is None
    q, k, v = torch.randn(3, 18, 2, 8, dtype=torch.float64)
    cu = torch.tensor(bounds, dtype=torch.int32)
    for causal in (True, False):
        plain = packed_causal_attention(q, k, v, cu, scale=0.3, causal=causal)
        given = packed_causal_attention(
            q, k, v, cu, scale=0.3, causal=causal, bounds=bounds, by_length=groups
        )
        assert torch.equal(plain, given)


def _graph_ops(t: torch.Tensor) -> set[str]:
    seen, todo, names = set(), [t.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn).__name__)
        todo += [f for f, _ in fn.next_functions]
    return names


@pytest.mark.parametrize("causal", [False, True])
def test_equal_segments_tiling_the_pack_attend_in_place_with_the_same_result(causal: bool) -> None:
    """A ViT's windows (or frames of equal-sized images) tile the pack: one batched SDPA reads the
    projections in place (no row slices, whose backward zero-fills a whole gradient, and no output
    buffer), with the result and gradients of the masked reference and of the sliced path (the
    same windows with an extra segment after them)."""
    torch.manual_seed(0)
    lengths = [4] * 6
    q, k, v = (torch.randn(24, 4, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, 4, 8, 12, 16, 20, 24], dtype=torch.int32)
    out = packed_causal_attention(q, k, v, cu, scale=0.3, causal=causal)
    assert not {"SliceBackward0", "CopySlices", "IndexBackward0"} & _graph_ops(out)
    if causal:
        ref = _block_causal_reference(q, k, v, lengths, 0.3)
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    # the general path: the same six windows followed by a 3-token segment (two length groups)
    q2, k2, v2 = (
        torch.cat([x.detach(), torch.randn(3, 4, 8, dtype=torch.float64)]).requires_grad_() for x in (q, k, v)
    )
    cu2 = torch.tensor([*cu.tolist(), 27], dtype=torch.int32)
    out2 = packed_causal_attention(q2, k2, v2, cu2, scale=0.3, causal=causal)
    assert "CopySlices" in _graph_ops(out2)
    assert torch.equal(out, out2[:24])
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    grads2 = torch.autograd.grad(out2[:24].square().sum(), (q2, k2, v2))
    for g, g2 in zip(grads, grads2):
        assert torch.equal(g, g2[:24])
