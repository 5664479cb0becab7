"""Build real megatron-core models from Loong configs on the CPU and check what they are."""

import pytest
import torch

from loong_models import (
    FoundationConfig,
    ModelConfig,
    build_model,
    build_transformer_config,
    decoder_block_spec,
    resolve_backend,
)
from loong_models.attention import SDPAttention
from loong_models.norm import RMSNorm

FAMILIES = ["llama", "qwen2", "qwen3"]


def tiny(family: str, **kw) -> FoundationConfig:
    base = dict(family=family, num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                num_query_groups=2, kv_channels=16, vocab_size=200, max_position_embeddings=64)  # fmt: skip
    return FoundationConfig(**{**base, **kw})


def build(f: FoundationConfig):
    config = build_transformer_config(f, use_cpu_initialization=True, calculate_per_token_loss=True)
    return build_model(ModelConfig(foundation=f, layer_backend="local"), config, device_type="cpu")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tied", [True, False])
def test_built_model_has_the_configured_parameters(megatron_cpu, family, tied):
    f = tiny(family, tie_word_embeddings=tied)
    model = build(f)
    padding = (f.padded_vocab_size() - f.vocab_size) * f.hidden_size * (1 if tied else 2)
    assert sum(p.numel() for p in model.parameters()) == f.num_parameters() + padding
    names = {n for n, _ in model.named_parameters()}
    assert any(n.endswith("linear_qkv.bias") for n in names) == (family == "qwen2")
    assert any("q_layernorm" in n for n in names) == (family == "qwen3")
    assert ("output_layer.weight" in names) == (not tied)


def test_local_spec_uses_sdpa_and_loong_rmsnorm(megatron_cpu):
    f = tiny("qwen3")
    model = build(f)
    layer = model.decoder.layers[0]
    assert isinstance(layer.self_attention.core_attention, SDPAttention)
    assert isinstance(layer.input_layernorm, RMSNorm)
    assert isinstance(layer.self_attention.q_layernorm, RMSNorm)
    assert isinstance(model.decoder.final_layernorm, RMSNorm)


def test_forward_gives_per_token_loss_and_logits(megatron_cpu):
    model = build(tiny("llama"))
    tokens = torch.randint(0, 200, (2, 16))
    pos = torch.arange(16).expand(2, -1)
    logits = model(tokens, pos, None)
    assert logits.shape == (2, 16, 256)  # vocab padded to a multiple of 128
    loss = model(tokens, pos, None, labels=tokens)
    assert loss.shape == (2, 16) and torch.isfinite(loss).all()


def test_sdpa_matches_megatron_dot_product_attention(megatron_cpu):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    f = tiny("llama")
    config = build_transformer_config(f)
    args = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    sdpa, reference = SDPAttention(**args), DotProductAttention(**args)
    s, b = 12, 3
    q = torch.randn(s, b, 4, 16)
    k, v = torch.randn(s, b, 2, 16), torch.randn(s, b, 2, 16)  # GQA: 2 KV groups for 4 heads
    causal = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
    torch.testing.assert_close(sdpa(q, k, v, None), reference(q, k, v, causal), atol=1e-5, rtol=1e-5)


def test_layer_backend_choice():
    assert resolve_backend("auto", "cpu") == "local"
    assert resolve_backend("local", "cuda") == "local"
    with pytest.raises(ValueError, match="'flash' is not a valid LayerBackend"):
        resolve_backend("flash", "cpu")


def test_block_spec_has_one_layer_spec_per_layer(megatron_cpu):
    config = build_transformer_config(tiny("llama", num_layers=3))
    block = decoder_block_spec(config, backend="local")
    assert len(block.layer_specs) == 3 and block.layer_norm is RMSNorm


def test_the_local_backend_is_a_megatron_spec_provider():
    from megatron.core.models.backends import LocalSpecProvider as MegatronLocal
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from loong_models.specs import LocalSpecProvider, dit_modules, projector_mlp_spec, spec_provider

    local = spec_provider("local")
    assert isinstance(local, LocalSpecProvider) and isinstance(local, MegatronLocal)
    assert (local.core_attention(), local.layer_norm(rms_norm=True)) == (SDPAttention, RMSNorm)
    assert (local.column_parallel_linear(), local.row_parallel_linear()) == (ColumnParallelLinear, RowParallelLinear)
    assert not local.fuse_layernorm_and_linear()
    # every component takes its modules from the provider
    mlp = projector_mlp_spec("local")
    assert (mlp.linear_fc1, mlp.linear_fc2) == (ColumnParallelLinear, RowParallelLinear)
    assert dit_modules("local").core_attention is SDPAttention
