"""DeepSeek-V3.2 attention (absorbed MLA + Loong DSAttention) on the CPU, in-process.

* With ``index_topk`` >= the sequence length every causal key is selected, so the layer must equal
  megatron's dense ``MLASelfAttention`` on the same weights, forward and backward.
* The indexer is trained only by its KL loss, and that loss reaches nothing else.
* The loss follows megatron's per-token convention and the schedule's loss scale.
* Packed (THD) documents give what each document gives alone.
* A few optimizer steps through megatron's pipeline schedule lower both the LM and indexer losses.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossAutoScaler
from megatron.core.transformer.spec_utils import build_module

from loong_models import (
    ModelConfig,
    build_model,
    build_transformer_config,
    decoder_block_spec,
    load_model_config,
)
from loong_models.attention import DSAttention
from loong_models.foundation import FoundationConfig

S, B = 24, 2  # sequence, batch


@pytest.fixture(autouse=True)
def fresh_indexer_loss_scale():
    """megatron's scaler keeps its scale in a class attribute; a backward outside the schedule
    creates it 0-dim, and the schedule then copies a [1]-shaped scale into it. Start each test
    unset, as a training run does."""
    DSAIndexerLossAutoScaler.main_loss_backward_scale = None
    yield
    DSAIndexerLossAutoScaler.main_loss_backward_scale = None


def tiny(topk: int = 64, coeff: float = 0.01) -> FoundationConfig:
    f = load_model_config("deepseek-v32-tiny").foundation
    f.num_layers, f.hidden_size, f.ffn_hidden_size, f.vocab_size = 2, 64, 128, 256
    f.mla = dataclasses.replace(f.mla, q_lora_rank=48, kv_lora_rank=32, qk_head_dim=16, v_head_dim=16)
    f.num_attention_heads = 4
    f.sparse_attention = dataclasses.replace(
        f.sparse_attention, index_n_heads=4, index_head_dim=24, index_topk=topk, indexer_loss_coeff=coeff
    )
    f.validate()
    return f


def dsa_attention(f: FoundationConfig, **runtime):
    config = build_transformer_config(f, use_cpu_initialization=True, **runtime)
    spec = decoder_block_spec(config, backend="local").layer_specs[0].submodules.self_attention
    return build_module(spec, config=config, layer_number=1), config


class DenseCausalAttention(torch.nn.Module):
    """Plain softmax attention, [s, b, n, d] in, [s, b, n * d_v] out. megatron's local
    DotProductAttention cannot serve MLA (it takes no k_channels / v_channels)."""

    def __init__(self, softmax_scale: float, **_unused) -> None:
        super().__init__()
        self.scale = softmax_scale

    def forward(self, q, k, v, attention_mask, **_unused):
        scores = torch.einsum("sbnd,tbnd->bnst", q, k) * self.scale
        scores = scores.masked_fill(attention_mask, float("-inf"))
        out = torch.einsum("bnst,tbnd->sbnd", scores.softmax(-1), v)
        return out.reshape(*out.shape[:2], -1)


def dense_mla_attention(config):
    """megatron's (non-absorbed) MLASelfAttention with dense causal core attention."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules

    spec = get_gpt_layer_local_submodules(multi_latent_attention=True, qk_layernorm=True, normalization="RMSNorm")
    spec = dataclasses.replace(
        spec.self_attention, submodules=dataclasses.replace(spec.self_attention.submodules, core_attention=DenseCausalAttention)
    )
    return build_module(spec, config=config, layer_number=1)


def indexer_params(attn) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in attn.named_parameters() if ".indexer." in n}


def run(attn, x: torch.Tensor, causal_mask: bool = False) -> torch.Tensor:
    mask = torch.triu(torch.ones(1, 1, S, S, dtype=torch.bool), diagonal=1) if causal_mask else None
    out, _ = attn(x, mask)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    return out.detach()


def test_full_topk_equals_dense_mla_forward_and_backward(megatron_cpu):
    torch.manual_seed(0)
    sparse, config = dsa_attention(tiny(topk=S), calculate_per_token_loss=True)
    dense = dense_mla_attention(config)
    missing, unexpected = sparse.load_state_dict(dense.state_dict(), strict=False)
    assert not unexpected and set(missing) == {n for n in sparse.state_dict() if ".indexer." in n}
    assert isinstance(sparse.core_attention, DSAttention)
    x = torch.randn(S, B, config.hidden_size)
    x_dense, x_sparse = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.testing.assert_close(run(sparse, x_sparse), run(dense, x_dense, causal_mask=True), atol=1e-5, rtol=1e-4)
    # The indexer loss (coefficient > 0, training mode) adds nothing to any other gradient.
    torch.testing.assert_close(x_sparse.grad, x_dense.grad, atol=1e-5, rtol=1e-4)
    dense_params = dict(dense.named_parameters())
    for name, p in sparse.named_parameters():
        if ".indexer." not in name:
            torch.testing.assert_close(p.grad, dense_params[name].grad, atol=1e-5, rtol=1e-4, msg=name)


def test_packed_documents_attend_and_select_as_if_each_ran_alone(megatron_cpu):
    """THD: documents of 10 and 14 tokens packed back to back, the indexer's RoPE restarting at each
    and its selection (4 keys, so it drops keys) staying inside each; outputs and gradients equal
    the documents run one by one."""
    from loong_models.packed_seq import packed_seq_params

    torch.manual_seed(0)
    # per-token indexer loss: a sum over query tokens, so the packed sum is the documents' sum
    attn, config = dsa_attention(tiny(topk=4, coeff=1.0), calculate_per_token_loss=True)
    lengths = [10, 14]
    x = torch.randn(sum(lengths), 1, config.hidden_size)
    grad = torch.linspace(-1, 1, x.numel()).view_as(x)
    x_packed = x.clone().requires_grad_()
    cu = torch.tensor([0, 10, 24], dtype=torch.int32)
    out, _ = attn(x_packed, None, packed_seq_params=packed_seq_params(cu, max(lengths)))
    out.backward(grad)
    packed = {n: p.grad.clone() for n, p in attn.named_parameters()}
    attn.zero_grad()
    x_alone = x.clone().requires_grad_()
    alone = torch.cat([attn(part, None)[0] for part in x_alone.split(lengths)])
    alone.backward(grad)
    torch.testing.assert_close(out, alone, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(x_packed.grad, x_alone.grad, atol=1e-5, rtol=1e-4)
    for name, p in attn.named_parameters():  # relative to each gradient's size: the indexer's are ~1e-3
        assert (packed[name] - p.grad).abs().max() <= 1e-5 * p.grad.abs().max(), name
    assert all(g.abs().max() > 1e-4 for n, g in packed.items() if ".indexer." in n)  # its loss ran


def test_indexer_is_trained_only_by_its_loss(megatron_cpu):
    x = torch.randn(S, B, 64)
    torch.manual_seed(0)
    with_loss, _ = dsa_attention(tiny(topk=8, coeff=0.01))
    run(with_loss, x)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in indexer_params(with_loss).values())
    # Without its loss the indexer gets no gradient at all: selection is discrete and the
    # attention output does not depend on the indexer's weights differentiably.
    torch.manual_seed(0)
    no_loss, _ = dsa_attention(tiny(topk=8, coeff=0.0))
    run(no_loss, x)
    assert all(p.grad is None for p in indexer_params(no_loss).values())
    # ... and the main weights' gradients are the same with or without the indexer loss.
    for (name, a), (_, b) in zip(with_loss.named_parameters(), no_loss.named_parameters()):
        if ".indexer." not in name:
            torch.testing.assert_close(a.grad, b.grad, msg=name)


def test_indexer_loss_is_per_token_and_follows_the_schedule_scale(megatron_cpu):
    x = torch.randn(S, B, 64)
    losses, grads = {}, {}
    for per_token, scale in ((False, 1.0), (True, 1.0), (True, 2.0)):
        torch.manual_seed(0)
        attn, _ = dsa_attention(tiny(topk=8), calculate_per_token_loss=per_token)
        DSAIndexerLossAutoScaler.set_loss_scale(torch.full((1,), scale))  # the schedule's shape
        run(attn, x)
        losses[per_token, scale] = attn.core_attention.indexer_loss
        grads[per_token, scale] = attn.core_attention.indexer.linear_wk.weight.grad
    # per-token: a sum over the S * B query tokens (megatron divides by the token count later)
    torch.testing.assert_close(losses[True, 1.0], losses[False, 1.0] * S * B)
    torch.testing.assert_close(grads[True, 1.0], grads[False, 1.0] * S * B)
    torch.testing.assert_close(grads[True, 2.0], grads[True, 1.0] * 2)


def test_build_sets_megatron_fields_and_the_loss_scale_hook(megatron_cpu):
    f = tiny()
    config = build_transformer_config(f)
    assert config.multi_latent_attention and config.kv_lora_rank == 32 and config.dsa_indexer_topk == 64
    assert config.experimental_attention_variant is None  # Loong's spec, not megatron's DSA modules
    assert config.experimental_attention_variant_loss_scale_func == DSAIndexerLossAutoScaler.set_loss_scale


def _train_through_schedule(f: FoundationConfig, train_indexer: bool, steps: int = 10):
    """LM losses and the summed indexer loss per step, through megatron's pipeline schedule
    (which sets the indexer-loss scale through the hook build.py installs)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    torch.manual_seed(0)
    config = build_transformer_config(f, use_cpu_initialization=True, calculate_per_token_loss=True)
    model = build_model(ModelConfig(foundation=f, layer_backend="local"), config, device_type="cpu")
    for p in indexer_params(model).values():
        p.requires_grad_(train_indexer)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    tokens = torch.randint(0, f.vocab_size, (B, S + 1))
    batch = dict(tokens=tokens[:, :-1], labels=tokens[:, 1:], position_ids=torch.arange(S).expand(B, -1))

    def forward_step(data_iterator, model):
        b = next(data_iterator)
        out = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
        return out, lambda t: (t.sum(), torch.tensor(t.numel()), {"lm": t.detach().mean()})

    lm, idx = [], []
    for _ in range(steps):
        opt.zero_grad()
        out = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([batch]), model=[model],
            num_microbatches=1, seq_length=S, micro_batch_size=B, forward_only=False,
        )  # fmt: skip
        opt.step()
        lm.append(float(out[0]["lm"]))
        idx.append(sum(float(layer.self_attention.core_attention.indexer_loss) for layer in model.decoder.layers))
    return lm, idx


def test_model_trains_through_megatron_schedule_and_the_indexer_learns(megatron_cpu):
    # index_topk >= S: the selection keeps every key, so the main model's trajectory does not
    # depend on the indexer, and a trained indexer can be compared with a frozen one on it.
    f = tiny(topk=S, coeff=1.0)
    lm, idx = _train_through_schedule(f, train_indexer=True)
    lm_frozen, idx_frozen = _train_through_schedule(f, train_indexer=False)
    assert lm[-1] < lm[0] - 0.5, lm
    assert lm == pytest.approx(lm_frozen, rel=1e-6)  # the indexer loss leaves the LM alone
    assert idx[0] == pytest.approx(idx_frozen[0], rel=1e-6)
    assert idx[-1] < 0.8 * idx_frozen[-1], (idx, idx_frozen)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(mla=None), "model.foundation.mla is required by family 'deepseek-v32'"),
        (dict(sparse_attention=None), "model.foundation.sparse_attention is required"),
        (dict(num_query_groups=4), "model.foundation.num_query_groups does not apply"),
        (dict(family="llama"), "model.foundation.mla is set but family 'llama' does not use it; .*deepseek-v32"),
    ],
)
def test_config_errors_name_the_key(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(tiny(), **change).validate()


@pytest.mark.parametrize(
    "mla, dsa, message",
    [
        (dict(q_lora_rank=None), {}, "mla.q_lora_rank must be set with sparse_attention"),
        (dict(qk_pos_emb_head_dim=15), {}, "mla.qk_pos_emb_head_dim=15 must be even"),
        (dict(kv_lora_rank=0), {}, "mla.kv_lora_rank=0 must be >= 1"),
        ({}, dict(index_topk=0), "sparse_attention.index_topk=0 must be >= 1"),
        ({}, dict(indexer_loss_coeff=-1.0), "sparse_attention.indexer_loss_coeff=-1.0 must be >= 0"),
        ({}, dict(index_head_dim=8), "sparse_attention.index_head_dim=8 must be >= mla.qk_pos_emb_head_dim=16"),
    ],
)
def test_sub_config_errors_name_the_key(mla, dsa, message):
    f = tiny()
    f = dataclasses.replace(
        f, mla=dataclasses.replace(f.mla, **mla), sparse_attention=dataclasses.replace(f.sparse_attention, **dsa)
    )
    with pytest.raises(ValueError, match=message):
        f.validate()


def test_built_model_has_the_configured_parameters(megatron_cpu):
    f = tiny()
    config = build_transformer_config(f, use_cpu_initialization=True)
    model = build_model(ModelConfig(foundation=f, layer_backend="local"), config, device_type="cpu")
    padding = (f.padded_vocab_size() - f.vocab_size) * f.hidden_size  # tied embeddings
    assert sum(p.numel() for p in model.parameters()) == f.num_parameters() + padding


def test_selective_recompute_still_trains_the_indexer(megatron_cpu):
    # core attention is recomputed in backward: its first forward runs without grad (no loss),
    # and the recomputation attaches the indexer loss
    x = torch.randn(S, B, 64)
    grads = {}
    for recompute in (None, "selective"):
        torch.manual_seed(0)
        attn, config = dsa_attention(dataclasses.replace(tiny(topk=8), recompute=recompute))
        assert attn.checkpoint_core_attention == (recompute == "selective")
        run(attn, x)
        grads[recompute] = {n: p.grad for n, p in attn.named_parameters()}
    for name, g in grads[None].items():
        torch.testing.assert_close(grads["selective"][name], g, msg=name)
