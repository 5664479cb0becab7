"""Loong builds the GPT decoder's layer specs itself from one spec provider per backend: the same
layers as megatron-core's own GPT builders, with the provider's modules where they differ."""

from __future__ import annotations

import dataclasses
import functools

import pytest

from loong_models import build_transformer_config, decoder_block_spec, load_model_config
from loong_models.specs import LayerShape, layer_spec, spec_provider, te_installed

# the zoo's tiny models with GQA + q/k norms, MoE with dense layers, MLA
MODELS = {"llama": ("tiny", []), "qwen3": ("qwen3-0.6b", ["foundation.num_layers=2"]),
          "moe": ("qwen3-moe-tiny", []), "mla": ("deepseek-v3-tiny", [])}  # fmt: skip


def tree(spec, swap: dict | None = None):
    """A spec as comparable data (megatron builds MLP specs as functools.partial, which compare by
    identity), with the modules in ``swap`` replaced."""
    swap = swap or {}
    if isinstance(spec, functools.partial):
        return ("partial", tree(spec.func, swap), {k: tree(v, swap) for k, v in spec.keywords.items()})
    if isinstance(spec, type):
        return swap.get(spec, spec)
    if dataclasses.is_dataclass(spec):
        return (type(spec), {f.name: tree(getattr(spec, f.name), swap) for f in dataclasses.fields(spec)})
    if isinstance(spec, list | tuple):
        return [tree(s, swap) for s in spec]
    if isinstance(spec, dict):
        return {k: tree(v, swap) for k, v in spec.items()}
    return spec


def config_of(name: str):
    model, overrides = MODELS[name]
    return build_transformer_config(load_model_config(model, overrides).foundation, use_cpu_initialization=True)


@pytest.mark.parametrize("name", MODELS)
def test_the_local_block_is_megatrons_local_gpt_block_with_sdpa_and_loong_rmsnorm(megatron_cpu, name):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from loong_models.attention import SDPAttention
    from loong_models.norm import RMSNorm, tp_replicated

    config = config_of(name)
    theirs = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    if config.multi_latent_attention:  # MLA's latent norms take Loong's TP gradient correction
        theirs = with_latent_norms(theirs, tp_replicated(WrappedTorchNorm))
    swap = {DotProductAttention: SDPAttention, WrappedTorchNorm: RMSNorm}
    assert tree(decoder_block_spec(config, backend="local")) == tree(theirs, swap)


def with_latent_norms(block, norm):
    """A block spec of MLA layers with ``norm`` as their query and KV latent norms."""

    def layer(spec):
        attn = spec.submodules.self_attention
        attn = dataclasses.replace(
            attn, submodules=dataclasses.replace(attn.submodules, q_layernorm=norm, kv_layernorm=norm)
        )
        return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attn))

    return dataclasses.replace(block, layer_specs=[layer(s) for s in block.layer_specs])


@pytest.mark.gpu
@pytest.mark.skipif(not te_installed(), reason="needs transformer-engine (CUDA)")
@pytest.mark.parametrize("name", MODELS)
def test_the_te_block_is_megatrons_te_gpt_block(megatron_cpu, name):
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    config = config_of(name)
    theirs = get_gpt_decoder_block_spec(config, use_transformer_engine=True, normalization="RMSNorm")
    assert tree(decoder_block_spec(config, backend="te")) == tree(theirs)
    assert tree(layer_spec(spec_provider("te"), LayerShape())) == tree(get_gpt_layer_with_transformer_engine_spec())
    fused = get_gpt_layer_with_transformer_engine_spec(use_te_op_fuser=True)  # model.fused_mlp
    assert tree(layer_spec(spec_provider("te"), LayerShape(te_op_fuser=True))) == tree(fused)


def test_every_module_of_a_local_layer_comes_from_the_provider():
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from loong_models.attention import SDPAttention
    from loong_models.norm import RMSNorm

    sub = layer_spec(spec_provider("local"), LayerShape(qk_layernorm=True)).submodules
    attn = sub.self_attention.submodules
    assert (sub.input_layernorm, sub.pre_mlp_layernorm, attn.q_layernorm, attn.k_layernorm) == (RMSNorm,) * 4
    assert (attn.linear_qkv, attn.core_attention, attn.linear_proj) == (ColumnParallelLinear, SDPAttention, RowParallelLinear)
    mlp = sub.mlp.keywords["submodules"]
    assert (mlp.linear_fc1, mlp.linear_fc2) == (ColumnParallelLinear, RowParallelLinear)
