"""The mapping mechanism: transforms invert, TP shards assemble into the global tensor, and every
loong_models family with an HF architecture has a declaration."""

from __future__ import annotations

import pytest
import torch

from loong_ckpt.families import MAPPINGS, get_mapping
from loong_ckpt.mapping import GATE_UP, QKV, Rule, Split
from loong_ckpt.testing import DictReader
from loong_models import FAMILIES, FoundationConfig

CFG = FoundationConfig(num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=8,
                       num_query_groups=4, kv_channels=4, vocab_size=100, make_vocab_size_divisible_by=16)  # fmt: skip


def test_every_llm_family_has_a_mapping():
    assert set(MAPPINGS) == set(FAMILIES)
    with pytest.raises(ValueError, match="no HF mapping is declared for family 'mamba'; families with one: "
                                         "llama, qwen2, qwen3, qwen3-moe, deepseek-v3, deepseek-v32"):  # fmt: skip
        get_mapping("mamba")


def test_units_and_locate_handle_indexed_stacked_and_expert_keys():
    """MoE layers after dense ones: per-layer rules apply where they should; keys are found whether
    megatron indexes layers (decoder.layers.<i>.*) or stacks them, under either spec's norm name."""
    from loong_ckpt.mapping import locate, units
    from loong_models.foundation import MoEConfig

    cfg = FoundationConfig(family="qwen3-moe", num_layers=3, num_query_groups=2, kv_channels=16,
                           moe=MoEConfig(num_experts=4, ffn_hidden_size=8, first_k_dense=1))  # fmt: skip
    rules = [r for r in get_mapping("qwen3-moe").rules if r.applies(cfg)]
    got = [(r.mcore.rsplit("mlp.", 1)[-1], i, e) for r, i, e in units(rules, cfg) if "mlp." in r.mcore]
    assert ("linear_fc2.weight", 0, None) in got and ("linear_fc2.weight", 1, None) not in got
    assert ("router.weight", 0, None) not in got and ("router.weight", 2, None) in got
    assert [e for name, i, e in got if i == 1 and name == "experts.experts.linear_fc1.weight"] == [0, 1, 2, 3]
    by_key = get_mapping("qwen3-moe").by_mcore_key()
    fc1 = by_key["decoder.layers.mlp.experts.experts.linear_fc1.weight"]
    u = locate(fc1, 2, 3, {"decoder.layers.2.mlp.experts.experts.linear_fc1.weight"})
    assert (u.key, u.prefix) == ("decoder.layers.2.mlp.experts.experts.linear_fc1.weight", (3,))
    u = locate(fc1, 2, 3, {"decoder.layers.mlp.experts.experts.linear_fc1.weight"})
    assert (u.key, u.prefix) == ("decoder.layers.mlp.experts.experts.linear_fc1.weight", (2, 3))
    norm = by_key["decoder.layers.mlp.linear_fc1.layer_norm_weight"]
    assert (
        locate(norm, 1, None, {"decoder.layers.1.pre_mlp_layernorm.weight"}).key
        == "decoder.layers.1.pre_mlp_layernorm.weight"
    )
    assert locate(norm, 1, None, {"decoder.layers.0.pre_mlp_layernorm.weight"}) is None
    assert fc1.hf_names(2, 3) == [
        "model.layers.2.mlp.experts.3.gate_proj.weight",
        "model.layers.2.mlp.experts.3.up_proj.weight",
    ]


def test_qkv_layout_is_megatrons():
    """Per KV group: its q heads, then its k head, then its v head."""
    d, h = CFG.head_dim, CFG.hidden_size
    q = torch.arange(8 * d).repeat_interleave(h).reshape(8 * d, h).float()
    k, v = (
        -1 - torch.arange(4 * d).float()[:, None].expand(4 * d, h),
        1000 + torch.arange(4 * d).float()[:, None].expand(4 * d, h),
    )
    fused = QKV.fuse([q, k, v], CFG, 4)
    group0 = fused[: 4 * d, 0]
    assert torch.equal(group0[: 2 * d], q[: 2 * d, 0]) and torch.equal(group0[2 * d : 3 * d], k[:d, 0])
    assert torch.equal(group0[3 * d :], v[:d, 0])
    assert all(torch.equal(a, b) for a, b in zip(QKV.unfuse(fused, CFG, 4), (q, k, v)))


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("family", sorted(MAPPINGS))
def test_tp_shards_assemble_the_global_tensor(family, tp):
    """Concatenating every rank's shard along the split dim gives the global megatron tensor
    (which is what megatron checkpoints store), for every rule of every family."""
    torch.manual_seed(0)
    padded = CFG.padded_vocab_size(tp)
    for rule in get_mapping(family).rules:
        layer = 0 if rule.layered else None
        shapes = {
            "embedding.word_embeddings.weight": (padded, 32), "output_layer.weight": (padded, 32),
        }  # fmt: skip
        layer_shape = shapes.get(rule.mcore) or _mcore_shape(rule)
        hf = {n: torch.randn(s) for n, s in zip(rule.hf_names(layer), rule.hf_shapes(layer_shape, CFG))}
        whole = rule.to_mcore(list(hf.values()), CFG, padded)
        assert tuple(whole.shape) == tuple(layer_shape), rule.mcore
        shards = [rule.tp_shard(DictReader(hf), layer, CFG, r, tp, padded) for r in range(tp)]
        if rule.split is Split.REPLICATED:
            assert all(torch.equal(s, whole) for s in shards)
        elif rule.transform is GATE_UP:  # megatron's fc1 global layout: [gate(all ranks); up(all ranks)]
            gates = [s.chunk(2)[0] for s in shards]
            ups = [s.chunk(2)[1] for s in shards]
            assert torch.equal(torch.cat(gates + ups), whole)
        else:
            assert torch.equal(torch.cat(shards, dim=rule.split.dim), whole), rule.mcore
        back = rule.to_hf(whole, CFG)
        assert all(torch.equal(a, b) for a, b in zip(back, hf.values()))


def _mcore_shape(rule: Rule) -> tuple[int, ...]:
    h, f, d = CFG.hidden_size, CFG.ffn_hidden_size, CFG.head_dim
    qkv = (CFG.num_attention_heads + 2 * CFG.query_groups) * d
    shapes = {
        "linear_qkv.weight": (qkv, h), "linear_qkv.bias": (qkv,), "linear_proj.weight": (h, CFG.num_attention_heads * d),
        "linear_fc1.weight": (2 * f, h), "linear_fc2.weight": (h, f), "layer_norm_weight": (h,),
        "q_layernorm.weight": (d,), "k_layernorm.weight": (d,), "final_layernorm.weight": (h,),
    }  # fmt: skip
    return next(
        (v for k, v in shapes.items() if rule.mcore.endswith(k)), (16, 32)
    )  # identity rules: any shape


def test_rule_arity_is_checked():
    with pytest.raises(ValueError, match="does not take 2 tensors"):
        Rule("x", ("a", "b"), Split.COLUMN, QKV)


def test_float_config_fields_compare_with_a_tolerance():
    from loong_ckpt.hf_config import arch_diff, same_architecture

    a = FoundationConfig(norm_epsilon=1e-5, rotary_base=10000.0)
    b = FoundationConfig(norm_epsilon=1.0000000000000001e-05 * (1 + 1e-9), rotary_base=10000)
    assert same_architecture(a, b) and arch_diff(a, b) == []
    c = FoundationConfig(norm_epsilon=1e-6)
    assert not same_architecture(a, c) and arch_diff(a, c) == ["norm_epsilon: 1e-05 != 1e-06"]
