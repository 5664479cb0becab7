"""Per-family mappings: declarations only, registered against loong_models' family names.

Adding a family means adding a :class:`FamilyMapping` to :data:`MAPPINGS` (and the family itself to
``loong_models.FAMILIES``). Rules whose megatron key the model does not have (e.g. ``output_layer``
of a model with tied embeddings, QKV bias of a family without one) are skipped, so a family can
list everything its variants may hold.
"""

from __future__ import annotations

from loong_ckpt.mapping import GATE_UP, QKV, FamilyMapping, Rule, Split
from loong_models import FAMILIES

_L = "decoder.layers."
_H = "model.layers.{i}."

# The dense pre-norm decoder (RMSNorm, GQA attention, SwiGLU MLP) shared by Llama and Qwen.
DENSE_DECODER: tuple[Rule, ...] = (
    Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), Split.VOCAB),
    Rule(_L + "self_attention.linear_qkv.layer_norm_weight", (_H + "input_layernorm.weight",), Split.REPLICATED),
    Rule(
        _L + "self_attention.linear_qkv.weight",
        (_H + "self_attn.q_proj.weight", _H + "self_attn.k_proj.weight", _H + "self_attn.v_proj.weight"),
        Split.COLUMN,
        QKV,
    ),
    Rule(_L + "self_attention.linear_proj.weight", (_H + "self_attn.o_proj.weight",), Split.ROW),
    Rule(_L + "mlp.linear_fc1.layer_norm_weight", (_H + "post_attention_layernorm.weight",), Split.REPLICATED),
    Rule(_L + "mlp.linear_fc1.weight", (_H + "mlp.gate_proj.weight", _H + "mlp.up_proj.weight"), Split.COLUMN, GATE_UP),
    Rule(_L + "mlp.linear_fc2.weight", (_H + "mlp.down_proj.weight",), Split.ROW),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",), Split.REPLICATED),
    Rule("output_layer.weight", ("lm_head.weight",), Split.VOCAB, when=lambda c: not c.tie_word_embeddings),
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

MAPPINGS: dict[str, FamilyMapping] = {
    m.family: m
    for m in (
        FamilyMapping("llama", DENSE_DECODER),
        FamilyMapping("qwen2", DENSE_DECODER + QKV_BIAS),
        FamilyMapping("qwen3", DENSE_DECODER + QK_NORM),
    )
}


def get_mapping(family: str) -> FamilyMapping:
    try:
        return MAPPINGS[family]
    except KeyError:
        raise ValueError(
            f"no HF mapping is declared for family {family!r}; families with one: {', '.join(MAPPINGS)}"
        ) from None


def supported_architectures() -> dict[str, str]:
    """HF ``architectures`` entry -> loong family, for every family with a mapping."""
    return {arch: name for name, fam in FAMILIES.items() if name in MAPPINGS for arch in fam.hf_architectures}
