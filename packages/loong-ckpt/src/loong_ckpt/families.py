"""Per-family mappings: declarations only, registered against loong_models' family names.

Adding a family means adding a :class:`FamilyMapping` to :data:`MAPPINGS` (and the family itself to
``loong_models.FAMILIES``). Tensors only some variants have carry a ``when=`` predicate on the
config (``output_layer`` without tied embeddings, shared experts, the expert bias), tensors only
some layers have an ``on_layer=`` one (dense MLP on the first k layers, router and experts on the
rest); the converter checks that the applicable rules cover the built model exactly.
"""

from __future__ import annotations

import dataclasses

import torch

from loong_ckpt.mapping import GATE_UP, QKV, FamilyMapping, Rule, Split
from loong_models import FAMILIES, FoundationConfig

_L = "decoder.layers."
_H = "model.layers.{i}."
_E = _H + "mlp.experts.{e}."


def _dense_mlp_layer(c: FoundationConfig, i: int) -> bool:
    return c.moe is None or i < c.moe.first_k_dense


def _moe_layer(c: FoundationConfig, i: int) -> bool:
    return c.moe is not None and i >= c.moe.first_k_dense


EMBEDDING_AND_HEAD: tuple[Rule, ...] = (
    Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), Split.VOCAB),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",), Split.REPLICATED),
    Rule("output_layer.weight", ("lm_head.weight",), Split.VOCAB, when=lambda c: not c.tie_word_embeddings),
)

GQA_ATTENTION: tuple[Rule, ...] = (
    Rule(
        _L + "self_attention.linear_qkv.layer_norm_weight", (_H + "input_layernorm.weight",), Split.REPLICATED
    ),
    Rule(
        _L + "self_attention.linear_qkv.weight",
        (_H + "self_attn.q_proj.weight", _H + "self_attn.k_proj.weight", _H + "self_attn.v_proj.weight"),
        Split.COLUMN,
        QKV,
    ),
    Rule(_L + "self_attention.linear_proj.weight", (_H + "self_attn.o_proj.weight",), Split.ROW),
)

# The pre-MLP norm (every layer, dense or MoE) and the dense SwiGLU MLP (dense layers only).
DENSE_MLP: tuple[Rule, ...] = (
    Rule(_L + "mlp.linear_fc1.layer_norm_weight", (_H + "post_attention_layernorm.weight",), Split.REPLICATED,
         aliases=(_L + "pre_mlp_layernorm.weight",)),  # a separate norm: MoE layers with TE, MLA layers locally
    Rule(_L + "mlp.linear_fc1.weight", (_H + "mlp.gate_proj.weight", _H + "mlp.up_proj.weight"), Split.COLUMN, GATE_UP,
         on_layer=_dense_mlp_layer),
    Rule(_L + "mlp.linear_fc2.weight", (_H + "mlp.down_proj.weight",), Split.ROW, on_layer=_dense_mlp_layer),
)  # fmt: skip

# The dense pre-norm decoder (RMSNorm, GQA attention, SwiGLU MLP) shared by Llama and Qwen.
DENSE_DECODER: tuple[Rule, ...] = EMBEDDING_AND_HEAD + GQA_ATTENTION + DENSE_MLP

# Multi-latent attention (DeepSeek-V2/V3), megatron's MLASelfAttention. Megatron applies RoPE to
# the de-interleaved rope dims (mla_rotary_interleaved), exactly as HF's rope_interleave=True does,
# so the rope rows of q_b_proj / kv_a_proj_with_mqa need no permutation.
MLA_ATTENTION: tuple[Rule, ...] = (
    Rule(_L + "input_layernorm.weight", (_H + "input_layernorm.weight",), Split.REPLICATED),
    Rule(_L + "self_attention.linear_q_proj.weight", (_H + "self_attn.q_proj.weight",), Split.COLUMN,
         when=lambda c: c.mla.q_lora_rank is None),
    Rule(_L + "self_attention.linear_q_down_proj.weight", (_H + "self_attn.q_a_proj.weight",), Split.COLUMN,
         when=lambda c: c.mla.q_lora_rank is not None),
    Rule(_L + "self_attention.q_layernorm.weight", (_H + "self_attn.q_a_layernorm.weight",), Split.REPLICATED,
         when=lambda c: c.mla.q_lora_rank is not None, aliases=(_L + "self_attention.linear_q_up_proj.layer_norm_weight",)),
    Rule(_L + "self_attention.linear_q_up_proj.weight", (_H + "self_attn.q_b_proj.weight",), Split.COLUMN,
         when=lambda c: c.mla.q_lora_rank is not None),
    Rule(_L + "self_attention.linear_kv_down_proj.weight", (_H + "self_attn.kv_a_proj_with_mqa.weight",), Split.COLUMN),
    Rule(_L + "self_attention.kv_layernorm.weight", (_H + "self_attn.kv_a_layernorm.weight",), Split.REPLICATED,
         aliases=(_L + "self_attention.linear_kv_up_proj.layer_norm_weight",)),
    Rule(_L + "self_attention.linear_kv_up_proj.weight", (_H + "self_attn.kv_b_proj.weight",), Split.COLUMN),
    Rule(_L + "self_attention.linear_proj.weight", (_H + "self_attn.o_proj.weight",), Split.ROW),
)  # fmt: skip

# MoE layers: router (+ DeepSeek-V3's score-correction bias, megatron's fp32 expert_bias), routed
# experts (one HF tensor set per expert, megatron's expert axis) and shared experts.
MOE_MLP: tuple[Rule, ...] = (
    Rule(_L + "mlp.router.weight", (_H + "mlp.gate.weight",), Split.REPLICATED, on_layer=_moe_layer),
    Rule(_L + "mlp.router.expert_bias", (_H + "mlp.gate.e_score_correction_bias",), Split.REPLICATED,
         when=lambda c: c.moe is not None and c.moe.expert_bias, on_layer=_moe_layer, dtype=torch.float32),
    Rule(_L + "mlp.experts.experts.linear_fc1.weight", (_E + "gate_proj.weight", _E + "up_proj.weight"), Split.COLUMN,
         GATE_UP, on_layer=_moe_layer),
    Rule(_L + "mlp.experts.experts.linear_fc2.weight", (_E + "down_proj.weight",), Split.ROW, on_layer=_moe_layer),
    Rule(_L + "mlp.shared_experts.linear_fc1.weight",
         (_H + "mlp.shared_experts.gate_proj.weight", _H + "mlp.shared_experts.up_proj.weight"), Split.COLUMN, GATE_UP,
         when=lambda c: c.moe is not None and bool(c.moe.shared_expert_intermediate_size), on_layer=_moe_layer),
    Rule(_L + "mlp.shared_experts.linear_fc2.weight", (_H + "mlp.shared_experts.down_proj.weight",), Split.ROW,
         when=lambda c: c.moe is not None and bool(c.moe.shared_expert_intermediate_size), on_layer=_moe_layer),
)  # fmt: skip

# DeepSeek-V3.2's lightning indexer (loong_models' LightningIndexer, megatron's DSAIndexer names),
# the core attention's submodule. Replicated on every TP rank, as loong_models builds it. HF rotates
# the first qk_rope_head_dim dims of its q / k by halves (not interleaved), as the indexer does, so
# the rows need no permutation; HF's bf16 indexer skips the reference's Hadamard rotation and FP8
# scoring, and so does Loong's (the rotation leaves every q . k unchanged).
_IDX = _L + "self_attention.core_attention.indexer."
DSA_INDEXER: tuple[Rule, ...] = (
    Rule(_IDX + "linear_wq_b.weight", (_H + "self_attn.indexer.wq_b.weight",), Split.REPLICATED),
    Rule(_IDX + "linear_wk.weight", (_H + "self_attn.indexer.wk.weight",), Split.REPLICATED),
    Rule(_IDX + "k_norm.weight", (_H + "self_attn.indexer.k_norm.weight",), Split.REPLICATED),
    Rule(_IDX + "k_norm.bias", (_H + "self_attn.indexer.k_norm.bias",), Split.REPLICATED),
    Rule(
        _IDX + "linear_weights_proj.weight", (_H + "self_attn.indexer.weights_proj.weight",), Split.REPLICATED
    ),
)

QKV_BIAS: tuple[Rule, ...] = (
    Rule(
        _L + "self_attention.linear_qkv.bias",
        (_H + "self_attn.q_proj.bias", _H + "self_attn.k_proj.bias", _H + "self_attn.v_proj.bias"),
        Split.COLUMN,
        QKV,
    ),
)

QK_NORM: tuple[Rule, ...] = (
    Rule(_L + "self_attention.q_layernorm.weight", (_H + "self_attn.q_norm.weight",), Split.REPLICATED),
    Rule(_L + "self_attention.k_layernorm.weight", (_H + "self_attn.k_norm.weight",), Split.REPLICATED),
)

# Multi-token prediction (DeepSeek-V3's and V3.2's num_nextn_predict_layers): HF stores MTP layer k as
# decoder layer num_hidden_layers + k. It holds a decoder layer like the last one (its tensors
# under megatron's ``mtp.layers.<k>.transformer_layer.``, see mtp_rules), plus these of its own ...
MTP_OWN: tuple[Rule, ...] = (
    Rule("mtp.layers.enorm.weight", (_H + "enorm.weight",), Split.REPLICATED),
    Rule("mtp.layers.hnorm.weight", (_H + "hnorm.weight",), Split.REPLICATED),
    Rule("mtp.layers.eh_proj.weight", (_H + "eh_proj.weight",), Split.COLUMN),  # [h, 2h]: [embedding; hidden]
    Rule("mtp.layers.final_layernorm.weight", (_H + "shared_head.norm.weight",), Split.REPLICATED),
)
# ... and copies of the main model's embedding and head, which megatron's MTP shares (HF MTP
# tensor suffix -> the HF tensor it copies): checked equal on import, written again on export.
MTP_SHARED: dict[str, str] = {"embed_tokens.weight": "model.embed_tokens.weight",
                              "shared_head.head.weight": "lm_head.weight"}  # fmt: skip

MAPPINGS: dict[str, FamilyMapping] = {
    m.family: m
    for m in (
        FamilyMapping("llama", DENSE_DECODER),
        FamilyMapping("qwen2", DENSE_DECODER + QKV_BIAS),
        FamilyMapping("qwen3", DENSE_DECODER + QK_NORM),
        FamilyMapping("qwen3-moe", DENSE_DECODER + QK_NORM + MOE_MLP),
        FamilyMapping("deepseek-v3", EMBEDDING_AND_HEAD + MLA_ATTENTION + DENSE_MLP + MOE_MLP, mtp=MTP_OWN),
        # The MTP layer of DeepSeek-V3.2's release (model.layers.61) is DeepSeek-V3's plus the indexer
        # of its DSA attention (HF's DeepseekV32 skips it on load; Loong trains it)
        FamilyMapping("deepseek-v32", EMBEDDING_AND_HEAD + MLA_ATTENTION + DSA_INDEXER + DENSE_MLP + MOE_MLP,
                      mtp=MTP_OWN),
    )
}


def get_mapping(family: str) -> FamilyMapping:
    try:
        return MAPPINGS[family]
    except KeyError:
        raise ValueError(
            f"no HF mapping is declared for family {family!r}; families with one: {', '.join(MAPPINGS)}"
        ) from None


def _in_mtp(name: str) -> str:
    return "mtp.layers.transformer_layer." + name.removeprefix(_L)


def mtp_rules(cfg: FoundationConfig) -> list[Rule]:
    """The rules of ``cfg``'s MTP layers (none without ``mtp_num_layers``), with layer indices
    counted from the first MTP layer: its decoder-layer tensors (the rules the last decoder layer
    has) and its own. A family without an HF layout for MTP refuses it."""
    if not cfg.mtp_num_layers:
        return []
    fam = get_mapping(cfg.family)
    if not fam.mtp:
        with_mtp = [m.family for m in MAPPINGS.values() if m.mtp]
        raise ValueError(f"model.foundation.mtp_num_layers={cfg.mtp_num_layers}: family {cfg.family!r} has no HF "
                         f"layout for MTP layers; families with one: {', '.join(with_mtp)}")  # fmt: skip
    last = cfg.num_layers - 1
    layer = [dataclasses.replace(r, mcore=_in_mtp(r.mcore), aliases=tuple(_in_mtp(a) for a in r.aliases), on_layer=None)
             for r in fam.rules if r.layered and r.applies(cfg) and r.has_layer(cfg, last)]  # fmt: skip
    return [dataclasses.replace(r, hf_layer_offset=cfg.num_layers) for r in (*layer, *fam.mtp)]


def mtp_copies(cfg: FoundationConfig) -> dict[str, str]:
    """HF tensor -> the HF tensor it copies, for the MTP layers' shared embedding and head."""
    head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    return {f"model.layers.{cfg.num_layers + k}.{suffix}": head if src == "lm_head.weight" else src
            for k in range(cfg.mtp_num_layers or 0) for suffix, src in MTP_SHARED.items()}  # fmt: skip


def supported_architectures() -> dict[str, str]:
    """HF ``architectures`` entry -> loong family, for every family with a mapping."""
    return {arch: name for name, fam in FAMILIES.items() if name in MAPPINGS for arch in fam.hf_architectures}


def key_aliases() -> dict[str, tuple[str, ...]]:
    """Megatron key -> the other keys the same tensor has under another layer spec (every family)."""
    out: dict[str, set[str]] = {}
    for fam in MAPPINGS.values():
        mtp = [dataclasses.replace(r, mcore=_in_mtp(r.mcore), aliases=tuple(map(_in_mtp, r.aliases)))
               for r in fam.rules if r.layered and fam.mtp]  # fmt: skip
        for r in (*fam.rules, *mtp):
            names = {r.mcore, *r.aliases}
            for n in names if r.aliases else ():
                out.setdefault(n, set()).update(names - {n})
    return {k: tuple(sorted(v)) for k, v in out.items()}
