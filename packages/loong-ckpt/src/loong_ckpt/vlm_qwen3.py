"""Qwen3-VL (``Qwen3VLForConditionalGeneration``) as a composed mapping: loong_models' image encoder
(``qwen3-vit``: LayerNorm ViT with learned + 2-D rotary positions and DeepStack taps), image
projector (the patch merger, plus one DeepStack merger per tap) and foundation (a Qwen3 LLM with
interleaved multimodal RoPE).

transformers (5.x) saves Qwen3-VL under its module names (``model.visual.*``,
``model.language_model.*``, ``lm_head``), as the released checkpoints do: one HF naming.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from loong_ckpt.composed import ComponentMapping, ModelMapping
from loong_ckpt.families import get_mapping
from loong_ckpt.hf_config import ConversionError, from_hf_config
from loong_ckpt.mapping import Rule, Split
from loong_ckpt.vlm import (
    _TOKEN_IDS,
    PackedQKVRule,
    _encoder_shapes,
    _mrope_section,
    _projector_shapes,
    composed_hf_config,
    same_composed,
)

ENCODER_TYPE = "qwen3-vit"
_L = "decoder.layers."
_B = "blocks.{i}."
_R, _C, _W = Split.REPLICATED, Split.COLUMN, Split.ROW


def _linear(mcore: str, hf: str, split: Split) -> tuple[Rule, Rule]:
    """A linear's weight and bias (a row-parallel bias is whole on every rank)."""
    return Rule(mcore + ".weight", (hf + ".weight",), split), Rule(mcore + ".bias", (hf + ".bias",),
                                                                   _R if split is _W else split)  # fmt: skip


def _norm(mcore: str, hf: str) -> tuple[Rule, Rule]:
    """A LayerNorm's weight and bias (megatron names a norm fused into the next linear ``layer_norm_*``)."""
    sep = "_" if mcore.endswith("layer_norm") else "."
    return Rule(mcore + sep + "weight", (hf + ".weight",), _R), Rule(
        mcore + sep + "bias", (hf + ".bias",), _R
    )


QWEN3_VIT: tuple[Rule, ...] = (
    # a biased Conv3d [hidden, channels, temporal_patch, patch, patch] on both sides
    *_linear("patch_embed.proj", "patch_embed.proj", _R),
    Rule("position_embedding.weight", ("pos_embed.weight",), _R),  # the learned (side x side) table
    *_norm(_L + "self_attention.linear_qkv.layer_norm", _B + "norm1"),
    PackedQKVRule(_L + "self_attention.linear_qkv.weight", (_B + "attn.qkv.weight",), _C),
    PackedQKVRule(_L + "self_attention.linear_qkv.bias", (_B + "attn.qkv.bias",), _C),
    *_linear(_L + "self_attention.linear_proj", _B + "attn.proj", _W),
    *_norm(_L + "mlp.linear_fc1.layer_norm", _B + "norm2"),
    *_linear(_L + "mlp.linear_fc1", _B + "mlp.linear_fc1", _C),
    *_linear(_L + "mlp.linear_fc2", _B + "mlp.linear_fc2", _W),
)


def _merger(mcore: str, hf: str) -> tuple[Rule, ...]:
    """A patch merger = loong's MLP projector: LayerNorm, fc1 (column-parallel), GELU, fc2 (row-parallel)."""
    return (*_norm(mcore + "norm", hf + "norm"), *_linear(mcore + "mlp.linear_fc1", hf + "linear_fc1", _C),
            *_linear(mcore + "mlp.linear_fc2", hf + "linear_fc2", _W))  # fmt: skip


def qwen3_projector_rules(cfg: Any) -> tuple[Rule, ...]:
    """The merger, then DeepStack merger ``j`` (``deepstack.<j>.`` <- ``deepstack_merger_list.<j>.``)."""
    deep = len(cfg.image_encoder.deepstack_visual_indexes)
    rules = _merger("", "merger.")
    for j in range(deep):
        rules += _merger(f"deepstack.{j}.", f"deepstack_merger_list.{j}.")
    return rules


# --- config.json <-> ModelConfig ----------------------------------------------------------------

_VISION_DEFAULTS = {"hidden_act": "gelu_pytorch_tanh", "in_channels": 3}  # HF's own defaults
_ENCODER_ARCH = ("type", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "patch_size",
                 "temporal_patch_size", "in_channels", "spatial_merge_size", "norm_epsilon", "rotary_base",
                 "image_size", "deepstack_visual_indexes")  # fmt: skip
_PROJECTOR_ARCH = ("type", "norm", "norm_epsilon", "ffn_hidden_size", "activation", "bias")


def _text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The LLM's fields as a Qwen3 config.json, without multimodal RoPE's keys."""
    text = dict(hf.get("text_config") or {})
    text["architectures"] = ["Qwen3ForCausalLM"]
    if "tie_word_embeddings" in hf:  # transformers 5 keeps it at the top level
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    rope = {k: v for k, v in (text.get("rope_parameters") or {}).items()
            if k not in ("mrope_section", "mrope_interleaved")}  # fmt: skip
    text["rope_parameters"] = rope
    return text


def _encoder(vision: dict[str, Any], source: str) -> Any:
    from loong_models import ImageEncoderConfig

    side = math.isqrt(vision["num_position_embeddings"])
    if side * side != vision["num_position_embeddings"]:
        raise ConversionError(f"{source}: vision_config.num_position_embeddings={vision['num_position_embeddings']} "
                              "is not a square (a side x side table)")  # fmt: skip
    theta = (vision.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    encoder = ImageEncoderConfig(
        type=ENCODER_TYPE, num_layers=vision["depth"], hidden_size=vision["hidden_size"],
        ffn_hidden_size=vision["intermediate_size"], num_attention_heads=vision["num_heads"],
        patch_size=vision["patch_size"], temporal_patch_size=vision["temporal_patch_size"],
        in_channels=vision["in_channels"], spatial_merge_size=vision["spatial_merge_size"],
        norm_epsilon=1e-6,  # HF hard-codes the ViT's and the mergers' LayerNorm eps
        rotary_base=float(theta), image_size=side * vision["patch_size"],
        deepstack_visual_indexes=list(vision.get("deepstack_visual_indexes") or []),
    )  # fmt: skip
    encoder.validate("vision_config")
    return encoder


def qwen3_vl_from_hf(hf: dict[str, Any], source: str = "config.json") -> Any:
    """config.json of a ``Qwen3VLForConditionalGeneration`` -> Loong ModelConfig."""
    from loong_models import ImageProjectorConfig, ModelConfig

    vision = hf.get("vision_config")
    if not isinstance(vision, dict) or not isinstance(hf.get("text_config"), dict):
        raise ConversionError(f"{source}: vision_config and text_config are required for Qwen3-VL")
    vision = {**_VISION_DEFAULTS, **vision}
    if vision["hidden_act"] != "gelu_pytorch_tanh":
        raise ConversionError(f"{source}: vision_config.hidden_act={vision['hidden_act']!r} is not supported for "
                              "Qwen3-VL; allowed: 'gelu_pytorch_tanh'")  # fmt: skip
    foundation = from_hf_config(_text_config(hf), source)
    out_hidden = vision.get("out_hidden_size", foundation.hidden_size)
    if out_hidden != foundation.hidden_size:
        raise ConversionError(f"{source}: vision_config.out_hidden_size={out_hidden} must equal the LLM's "
                              f"hidden_size={foundation.hidden_size}")  # fmt: skip
    section = _mrope_section(hf["text_config"], source)
    foundation = dataclasses.replace(foundation, mrope_section=section, mrope_interleaved=True)
    try:
        foundation.validate()
        encoder = _encoder(vision, source)
    except KeyError as e:
        raise ConversionError(f"{source}: vision_config.{e.args[0]} is missing") from None
    except ValueError as e:
        raise ConversionError(f"{source}: {e}") from None
    projector = ImageProjectorConfig(norm="LayerNorm", norm_epsilon=1e-6, activation="gelu", bias=True)
    ids = {k: hf[k] for k in _TOKEN_IDS if k in hf}
    if "image_token_id" not in ids:
        raise ConversionError(f"{source}: image_token_id is missing")
    model = ModelConfig(foundation=foundation, image_encoder=encoder, image_projector=projector, **ids)
    try:
        model.validate()
    except ValueError as e:
        raise ConversionError(f"{source}: {e}") from None
    return model


def qwen3_vl_to_hf(cfg: Any, dtype: torch.dtype) -> dict[str, Any]:
    """Loong ModelConfig -> config.json that transformers reads as Qwen3-VL."""
    f, e = cfg.foundation, cfg.image_encoder
    side = e.image_size // e.patch_size
    vision = {
        "depth": e.num_layers, "hidden_size": e.hidden_size,
        "intermediate_size": e.ffn_hidden_size, "num_heads": e.num_attention_heads,
        "hidden_act": "gelu_pytorch_tanh", "in_channels": e.in_channels, "patch_size": e.patch_size,
        "temporal_patch_size": e.temporal_patch_size, "spatial_merge_size": e.spatial_merge_size,
        "out_hidden_size": f.hidden_size, "num_position_embeddings": side * side,
        "deepstack_visual_indexes": list(e.deepstack_visual_indexes),
        "rope_parameters": {"rope_theta": e.rotary_base, "rope_type": "axial"},
        "initializer_range": e.init_method_std,
    }  # fmt: skip
    rope = {"mrope_section": list(f.mrope_section), "mrope_interleaved": True}
    return composed_hf_config(cfg, dtype, arch="Qwen3VLForConditionalGeneration", model_type="qwen3_vl",
                              rope=rope, vision=vision)  # fmt: skip


def qwen3_vl_same(a: Any, b: Any) -> bool:
    return same_composed(a, b, _ENCODER_ARCH, _PROJECTOR_ARCH, _TOKEN_IDS)


_VISUAL = {"modules": (("", "model.visual."),)}

QWEN3_VL = ModelMapping(
    name="qwen3-vl",
    hf_architectures=("Qwen3VLForConditionalGeneration",),
    encoder_type=ENCODER_TYPE,
    components=(
        ComponentMapping(
            "image_encoder", "image_encoder.", _VISUAL, rules=lambda cfg: QWEN3_VIT, shapes=_encoder_shapes
        ),  # fmt: skip
        ComponentMapping(
            "image_projector",
            "image_projector.",
            _VISUAL,
            rules=qwen3_projector_rules,
            shapes=_projector_shapes,
        ),  # fmt: skip
        ComponentMapping(
            "foundation",
            "foundation.",
            {"modules": (("model.", "model.language_model."),)},
            rules=lambda cfg: get_mapping(cfg.foundation.family).rules,
            shapes=lambda cfg: cfg.foundation,
        ),
    ),
    namings={"modules": "model.language_model.embed_tokens.weight"},
    from_hf=qwen3_vl_from_hf,
    to_hf=qwen3_vl_to_hf,
    same_architecture=qwen3_vl_same,
)
