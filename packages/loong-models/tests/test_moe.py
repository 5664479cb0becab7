"""Mixture-of-Experts foundations (Qwen3-MoE, DeepSeek-V3): schema, parameter counts of the
released checkpoints, and real megatron-core MoE models built on the CPU."""

import pytest
import torch

from loong_models import (
    FoundationConfig,
    ModelConfig,
    build_model,
    build_transformer_config,
    load_model_config,
)
from loong_models.attention import SDPAttention
from loong_models.foundation import MLAConfig, MoEConfig
from loong_models.norm import RMSNorm

# Parameter counts of the released HF checkpoints (DeepSeek-V3 without its MTP layer, with the
# routers' e_score_correction_bias), and the parameters one token uses.
RELEASED = {
    "qwen3-30b-a3b": (30_532_122_624, 3_353_032_704),
    "deepseek-v3": (671_026_419_200, 37_552_297_472),
}


@pytest.mark.parametrize("name, counts", RELEASED.items())
def test_parameter_counts_match_released_moe_models(name, counts):
    f = load_model_config(name).foundation
    assert (f.num_parameters(), f.num_active_parameters()) == counts


def test_active_parameters_equal_total_for_dense_models():
    f = load_model_config("qwen3-0.6b").foundation
    assert f.num_active_parameters() == f.num_parameters()


def build(f: FoundationConfig):
    config = build_transformer_config(f, use_cpu_initialization=True, calculate_per_token_loss=True,
                                      moe_token_dispatcher_type="alltoall")  # fmt: skip
    return build_model(ModelConfig(foundation=f, layer_backend="local"), config, device_type="cpu")


def _buffers(model, suffix: str) -> int:
    return sum(b.numel() for n, b in model.named_buffers() if n.endswith(suffix))


@pytest.mark.parametrize("name", ["qwen3-moe-tiny", "deepseek-v3-tiny"])
def test_tiny_moe_models_build_with_the_configured_parameters(megatron_cpu, name):
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    f = load_model_config(name).foundation
    model = build(f)
    padding = (f.padded_vocab_size() - f.vocab_size) * f.hidden_size * (1 if f.tie_word_embeddings else 2)
    params = sum(p.numel() for p in model.parameters())
    # megatron keeps the router's expert bias as a buffer; the released checkpoints count it
    assert params + _buffers(model, "router.expert_bias") == f.num_parameters() + padding
    moe = f.moe
    kinds = [isinstance(layer.mlp, MoELayer) for layer in model.decoder.layers]
    assert kinds == [False] * moe.first_k_dense + [True] * (f.num_layers - moe.first_k_dense)
    moe_layer = model.decoder.layers[-1].mlp
    assert (
        isinstance(moe_layer.experts, SequentialMLP)
        and len(moe_layer.experts.local_experts) == moe.num_experts
    )
    assert (moe_layer.shared_experts is not None) == bool(moe.shared_expert_intermediate_size)
    assert moe_layer.router.topk == moe.router_topk


def test_mla_without_dsa_builds_on_the_local_backend(megatron_cpu):
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    model = build(load_model_config("deepseek-v3-tiny").foundation)
    attn = model.decoder.layers[0].self_attention
    assert isinstance(attn, MLASelfAttention) and isinstance(attn.core_attention, SDPAttention)
    assert isinstance(attn.q_layernorm, RMSNorm) and isinstance(attn.kv_layernorm, RMSNorm)


@pytest.mark.parametrize("name", ["qwen3-moe-tiny", "deepseek-v3-tiny"])
def test_moe_forward_backward(megatron_cpu, name):
    f = load_model_config(name).foundation
    model = build(f)
    tokens = torch.randint(0, f.vocab_size, (2, 16))
    loss = model(tokens, torch.arange(16).expand(2, -1), None, labels=tokens)
    assert loss.shape == (2, 16) and torch.isfinite(loss).all()
    loss.mean().backward()
    router = model.decoder.layers[-1].mlp.router
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_router_options_reach_megatron():
    f = load_model_config(
        "deepseek-v3-tiny", ["foundation.moe.capacity_factor=1.25", "foundation.moe.router_topk=3"]
    ).foundation
    c = build_transformer_config(f)
    assert (c.num_moe_experts, c.moe_router_topk, c.moe_expert_capacity_factor) == (8, 3, 1.25)
    assert c.moe_router_score_function == "sigmoid" and c.moe_router_enable_expert_bias
    assert c.moe_layer_freq == [0, 1] and c.moe_router_load_balancing_type == "seq_aux_loss"
    assert (
        c.moe_router_num_groups == 4
        and c.moe_router_group_topk == 2
        and c.moe_router_topk_scaling_factor == 2.5
    )


def test_selective_recompute_modules_reach_megatron():
    f = load_model_config("deepseek-v3-tiny").foundation
    f.recompute, f.recompute_modules = "selective", ["mla_up_proj", "moe", "layernorm"]
    c = build_transformer_config(f)
    assert c.recompute_granularity == "selective" and c.recompute_modules == [
        "mla_up_proj",
        "moe",
        "layernorm",
    ]


def moe_cfg(**kw) -> FoundationConfig:
    base = dict(family="qwen3-moe", num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                moe=MoEConfig(**kw))  # fmt: skip
    return FoundationConfig(**base)


@pytest.mark.parametrize(
    "config, message",
    [
        (lambda: FoundationConfig(family="qwen3-moe"), r"model.foundation.moe is required by family 'qwen3-moe'"),
        (lambda: FoundationConfig(family="qwen3", moe=MoEConfig()), r"model.foundation.moe is set .*qwen3-moe"),
        (lambda: moe_cfg(router_topk=9), r"moe.router_topk=9 must be <= model.foundation.moe.num_experts=8"),
        (lambda: moe_cfg(first_k_dense=2), r"moe.first_k_dense=2 must be in \[0, num_layers=2\)"),
        (lambda: moe_cfg(num_groups=3, group_topk=1), r"moe.num_groups=3 must divide"),
        (lambda: moe_cfg(num_groups=4), r"moe.num_groups and model.foundation.moe.group_topk must be set together"),
        (lambda: moe_cfg(capacity_factor=0.0), r"moe.capacity_factor=0.0 must be > 0 or null"),
        (lambda: moe_cfg(pad_to_capacity=True), r"moe.pad_to_capacity=true needs"),
        (lambda: moe_cfg(load_balancing="none", aux_loss_coeff=0.1), r"moe.aux_loss_coeff=0.1 has no effect"),
        (lambda: FoundationConfig(recompute_modules=["core_attn"]), r"recompute_modules=\[core_attn\] needs .*selective"),
        (lambda: FoundationConfig(recompute="selective", recompute_modules=["moe"]), r"'moe' needs a moe: config"),
        (lambda: FoundationConfig(recompute="selective", recompute_modules=["mla_up_proj"]), r"needs an MLA family"),
        (lambda: FoundationConfig(family="deepseek-v3", mla=MLAConfig(), moe=MoEConfig(), recompute="selective",
                                  recompute_modules=["shared_experts"]), r"needs model.foundation.moe.shared_expert"),
    ],
)  # fmt: skip
def test_bad_moe_configs_name_the_key(config, message):
    with pytest.raises(ValueError, match=message):
        config().validate()


def test_moe_act_recompute_needs_grouped_gemm_experts():
    f = load_model_config("qwen3-moe-tiny").foundation
    f.recompute, f.recompute_modules = "selective", ["moe_act"]
    with pytest.raises(ValueError, match=r"'moe_act' needs grouped-GEMM experts \(model.layer_backend=te\)"):
        build_transformer_config(f, moe_grouped_gemm=False)
