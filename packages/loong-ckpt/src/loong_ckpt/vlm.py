"""Vision-language models: Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``) as a composed
mapping of loong_models' image encoder (``qwen2.5-vit``), image projector (the patch merger) and
foundation (a Qwen2 LLM with multimodal RoPE).

HF tensor names. transformers (5.x) holds the modules as ``model.visual.*``,
``model.language_model.*`` and ``lm_head``, but its ``save_pretrained`` writes the Hub's original
names, ``visual.*``, ``model.layers.*`` / ``model.embed_tokens`` / ``model.norm`` and ``lm_head``
(and ``from_pretrained`` reads both). Both namings are read here; the one a directory uses is
recorded, and export writes it back (``hub`` for a checkpoint trained from scratch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from loong_ckpt.composed import ComponentMapping, ModelMapping
from loong_ckpt.families import get_mapping
from loong_ckpt.hf_config import ConversionError, from_hf_config, same_architecture, same_value, to_hf_config
from loong_ckpt.mapping import GATE_UP, QKV, Rule, SliceReader, Split, Transform
from loong_xpu.tokens import VisionTokenIds

# --- the vision tower's transforms ------------------------------------------------------------


def _packed_fuse(ts: Sequence[torch.Tensor], c: Any, groups: int) -> torch.Tensor:
    return QKV.fuse(list(ts[0].chunk(3)), c, groups)


def _packed_unfuse(t: torch.Tensor, c: Any, groups: int) -> list[torch.Tensor]:
    return [torch.cat(QKV.unfuse(t, c, groups))]


# HF's ViT attention holds q, k, v in ONE tensor, whole ([q; k; v], each all heads); megatron's
# linear_qkv interleaves them per head group (groups = heads: no GQA in the ViT).
PACKED_QKV = Transform("packed_qkv", _packed_fuse, _packed_unfuse, lambda rows, c, g: [rows])


@dataclass(frozen=True)
class PackedQKVRule(Rule):
    """A rule over one packed ``[q; k; v]`` HF tensor. A tensor-parallel rank's share is its block
    of each of the three parts (not a block of the packed tensor), fused per head."""

    transform: Transform = PACKED_QKV

    def tp_shard(
        self, reader: SliceReader, layer, cfg, tp_rank: int, tp_size: int, padded_vocab: int, expert=None
    ):
        if tp_size == 1:
            return super().tp_shard(reader, layer, cfg, tp_rank, tp_size, padded_vocab, expert)
        (name,) = self.hf_names(layer, expert)
        third = reader.shape(name)[0] // 3
        per = third // tp_size
        parts = [
            reader.read(name, 0, j * third + tp_rank * per, j * third + (tp_rank + 1) * per) for j in range(3)
        ]
        return self.transform.fuse([torch.cat(parts)], cfg, cfg.query_groups // tp_size)


@dataclass(frozen=True)
class AttentionShapes:
    """What a ViT component's transforms read (the FoundationConfig attributes they use)."""

    num_layers: int
    num_attention_heads: int
    head_dim: int
    vocab_size: int = 0
    moe: None = None  # no experts (mapping.units counts them from here)
    # The MLP's width in HF and as Loong builds it (ImageEncoderConfig.padded_ffn_hidden_size).
    ffn_hidden_size: int = 0
    padded_ffn_hidden_size: int = 0

    @property
    def query_groups(self) -> int:
        return self.num_attention_heads  # plain multi-head attention


@dataclass(frozen=True)
class PaddedFfnRule(Rule):
    """A ViT MLP tensor whose intermediate axis (the split dim: fc1's rows, fc2's columns) Loong
    builds zero-padded to ``padded_ffn_hidden_size``: zeros are appended on import (each of the
    gate and up halves) and removed on export, which refuses padding that is not zero."""

    def _widths(self, cfg: Any) -> tuple[int, int, int]:
        return self.split.dim, getattr(cfg, "ffn_hidden_size", 0), getattr(cfg, "padded_ffn_hidden_size", 0)

    def _pad(self, t: torch.Tensor, width: int) -> torch.Tensor:
        dim = self.split.dim
        if t.shape[dim] >= width:
            return t
        shape = list(t.shape)
        shape[dim] = width - t.shape[dim]
        return torch.cat([t, t.new_zeros(shape)], dim=dim)

    def hf_shapes(self, mcore_shape, cfg):
        dim, real, padded = self._widths(cfg)
        shapes = super().hf_shapes(mcore_shape, cfg)
        return [tuple(real if i == dim and n == padded else n for i, n in enumerate(s)) for s in shapes]

    def to_mcore(self, hf, cfg, padded_vocab):
        padded = self._widths(cfg)[2]
        return super().to_mcore([self._pad(t, padded) for t in hf], cfg, padded_vocab)

    def to_hf(self, t, cfg):
        dim, real, padded = self._widths(cfg)
        out = []
        for part in super().to_hf(t, cfg):
            if padded > real and part.shape[dim] == padded:
                if part.narrow(dim, real, padded - real).any():
                    raise ConversionError(f"{self.mcore}: the MLP padding (units {real}..{padded - 1}) is not zero; "
                                     "a padded ViT MLP must keep it zero (see ImageEncoderConfig.pad_ffn_to)")  # fmt: skip
                part = part.narrow(dim, 0, real).contiguous()
            out.append(part)
        return out

    def tp_shard(self, reader, layer, cfg, tp_rank, tp_size, padded_vocab, expert=None):
        dim, real, padded = self._widths(cfg)
        if tp_size == 1 or padded <= real:
            return super().tp_shard(reader, layer, cfg, tp_rank, tp_size, padded_vocab, expert)
        per = padded // tp_size  # this rank's block of the padded axis, of which HF holds [start, stop)
        start, stop = min(tp_rank * per, real), min((tp_rank + 1) * per, real)
        names = self.hf_names(layer, expert)
        if start == stop:  # a rank of padding only: an empty read gives the dtype and other dims
            parts = [self._pad(reader.read(n, dim, start - 1, start).narrow(dim, 0, 0), per) for n in names]
        else:
            parts = [self._pad(reader.read(n, dim, start, stop), per) for n in names]
        return self.transform.fuse(parts, cfg, cfg.query_groups // tp_size)


# --- rules --------------------------------------------------------------------------------------

_L = "decoder.layers."
_B = "blocks.{i}."

QWEN25_VIT: tuple[Rule, ...] = (
    # a Conv3d [hidden, channels, temporal_patch, patch, patch] on both sides
    Rule("patch_embed.proj.weight", ("patch_embed.proj.weight",), Split.REPLICATED),
    Rule(_L + "self_attention.linear_qkv.layer_norm_weight", (_B + "norm1.weight",), Split.REPLICATED),
    PackedQKVRule(_L + "self_attention.linear_qkv.weight", (_B + "attn.qkv.weight",), Split.COLUMN),
    PackedQKVRule(_L + "self_attention.linear_qkv.bias", (_B + "attn.qkv.bias",), Split.COLUMN),
    Rule(_L + "self_attention.linear_proj.weight", (_B + "attn.proj.weight",), Split.ROW),
    Rule(_L + "self_attention.linear_proj.bias", (_B + "attn.proj.bias",), Split.REPLICATED),
    Rule(_L + "mlp.linear_fc1.layer_norm_weight", (_B + "norm2.weight",), Split.REPLICATED),
    PaddedFfnRule(
        _L + "mlp.linear_fc1.weight",
        (_B + "mlp.gate_proj.weight", _B + "mlp.up_proj.weight"),
        Split.COLUMN,
        GATE_UP,
    ),
    PaddedFfnRule(
        _L + "mlp.linear_fc1.bias",
        (_B + "mlp.gate_proj.bias", _B + "mlp.up_proj.bias"),
        Split.COLUMN,
        GATE_UP,
    ),
    PaddedFfnRule(_L + "mlp.linear_fc2.weight", (_B + "mlp.down_proj.weight",), Split.ROW),
    Rule(_L + "mlp.linear_fc2.bias", (_B + "mlp.down_proj.bias",), Split.REPLICATED),
)

# Qwen2.5-VL's patch merger = loong's MLP projector: RMSNorm per patch, 4 patches concatenated,
# fc1 (column-parallel), GELU, fc2 (row-parallel).
QWEN25_MERGER: tuple[Rule, ...] = (
    Rule("norm.weight", ("merger.ln_q.weight",), Split.REPLICATED),
    Rule("mlp.linear_fc1.weight", ("merger.mlp.0.weight",), Split.COLUMN),
    Rule("mlp.linear_fc1.bias", ("merger.mlp.0.bias",), Split.COLUMN),
    Rule("mlp.linear_fc2.weight", ("merger.mlp.2.weight",), Split.ROW),
    Rule("mlp.linear_fc2.bias", ("merger.mlp.2.bias",), Split.REPLICATED),
)


def _encoder_shapes(cfg: Any) -> AttentionShapes:
    e = cfg.image_encoder
    return AttentionShapes(e.num_layers, e.num_attention_heads, e.head_dim,
                           ffn_hidden_size=e.ffn_hidden_size, padded_ffn_hidden_size=e.padded_ffn_hidden_size)  # fmt: skip


def _projector_shapes(cfg: Any) -> AttentionShapes:
    return AttentionShapes(0, 1, 1)


# --- config.json <-> ModelConfig ----------------------------------------------------------------

ENCODER_TYPE = "qwen2.5-vit"
_TOKEN_IDS = tuple(f.name for f in dataclasses.fields(VisionTokenIds))  # HF's keys are the model's
_VISION_DEFAULTS = {"hidden_act": "silu", "in_channels": 3}  # HF's own defaults
# Vision fields the converted encoder determines (the rest are runtime knobs).
_ENCODER_ARCH = ("type", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "patch_size",
                 "temporal_patch_size", "in_channels", "spatial_merge_size", "norm_epsilon", "rotary_base",
                 "window_size", "fullatt_block_indexes")  # fmt: skip
_PROJECTOR_ARCH = ("type", "norm", "norm_epsilon", "ffn_hidden_size", "activation", "bias")


def _text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The LLM's config.json fields: ``text_config`` (transformers 5) or the top level (older
    Hub configs), as a text-family config.json (Qwen2)."""
    text = dict(
        hf.get("text_config") or {k: v for k, v in hf.items() if k not in ("vision_config", "text_config")}
    )
    text["architectures"] = ["Qwen2ForCausalLM"]
    if "tie_word_embeddings" in hf:  # transformers 5 keeps it at the top level
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    return text


def _mrope_section(text: dict[str, Any], source: str) -> list[int]:
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    section = rope.get("mrope_section")
    if not section or len(section) != 3:
        raise ConversionError(
            f"{source}: text_config.rope_parameters.mrope_section={section!r}; expected 3 integers"
        )
    return [int(x) for x in section]


def _strip_mrope(text: dict[str, Any]) -> dict[str, Any]:
    """The text config without multimodal RoPE's keys (the text mapping rejects unknown rope types)."""
    out = dict(text)
    for key in ("rope_parameters", "rope_scaling"):
        if out.get(key):
            rope = {k: v for k, v in out[key].items() if k != "mrope_section"}
            if rope.get("rope_type", rope.get("type")) == "mrope":
                rope["rope_type"] = "default"
                rope.pop("type", None)
            out[key] = rope
    return out


def qwen25_vl_from_hf(hf: dict[str, Any], source: str = "config.json") -> Any:
    """config.json of a ``Qwen2_5_VLForConditionalGeneration`` -> Loong ModelConfig."""
    from loong_models import ImageEncoderConfig, ImageProjectorConfig, ModelConfig

    vision = hf.get("vision_config")
    if not isinstance(vision, dict):
        raise ConversionError(f"{source}: vision_config is missing")
    vision = {**_VISION_DEFAULTS, **vision}
    if vision["hidden_act"] != "silu":
        raise ConversionError(
            f"{source}: vision_config.hidden_act={vision['hidden_act']!r} is not supported for Qwen2.5-VL; allowed: 'silu'"
        )
    theta = (vision.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    text = _text_config(hf)
    foundation = from_hf_config(_strip_mrope(text), source)
    out_hidden = vision.get("out_hidden_size", foundation.hidden_size)
    if out_hidden != foundation.hidden_size:
        raise ConversionError(
            f"{source}: vision_config.out_hidden_size={out_hidden} must equal the LLM's hidden_size={foundation.hidden_size}"
        )
    foundation = _with_mrope(foundation, _mrope_section(text, source))
    try:
        encoder = ImageEncoderConfig(
            type=ENCODER_TYPE, num_layers=vision["depth"], hidden_size=vision["hidden_size"],
            ffn_hidden_size=vision["intermediate_size"], num_attention_heads=vision["num_heads"],
            patch_size=vision["patch_size"], temporal_patch_size=vision["temporal_patch_size"],
            in_channels=vision["in_channels"], spatial_merge_size=vision["spatial_merge_size"],
            norm_epsilon=1e-6,  # HF hard-codes the ViT's and the merger's RMSNorm eps
            rotary_base=float(theta), window_size=vision["window_size"],
            fullatt_block_indexes=list(vision.get("fullatt_block_indexes") or []),
        )  # fmt: skip
        encoder.validate("vision_config")
    except KeyError as e:
        raise ConversionError(f"{source}: vision_config.{e.args[0]} is missing") from None
    except ValueError as e:
        raise ConversionError(f"{source}: {e}") from None
    projector = ImageProjectorConfig(norm="RMSNorm", norm_epsilon=1e-6, activation="gelu", bias=True)
    ids = {k: hf[k] for k in _TOKEN_IDS if k in hf}
    if "image_token_id" not in ids:
        raise ConversionError(f"{source}: image_token_id is missing")
    return ModelConfig(
        foundation=foundation,
        image_encoder=encoder,
        image_projector=projector,
        tokens_per_second=float(vision.get("tokens_per_second", 2)),  # video temporal positions
        **ids,
    )


def _with_mrope(foundation: Any, section: list[int]) -> Any:
    cfg = dataclasses.replace(foundation, mrope_section=section)
    try:
        cfg.validate()
    except ValueError as e:
        raise ConversionError(f"config.json text_config: {e}") from None
    return cfg


def composed_hf_config(cfg: Any, dtype: torch.dtype, *, arch: str, model_type: str, rope: dict[str, Any],
                       vision: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """config.json of a VLM: the foundation as ``<model_type>_text`` with ``rope`` added to its RoPE
    parameters, ``vision`` as the vision config, the token ids and tied embeddings at the top."""
    f = cfg.foundation
    plain = dataclasses.replace(f, mrope_section=None, mrope_interleaved=False)
    text = to_hf_config(plain, dtype)
    dtype_name = text.pop("dtype")
    for key in ("architectures", "tie_word_embeddings"):
        text.pop(key)
    text["model_type"] = f"{model_type}_text"
    text["rope_parameters"] = {**text["rope_parameters"], **rope}
    out = {"architectures": [arch], "model_type": model_type, "text_config": text,
           "vision_config": {"model_type": f"{model_type}_vision", **vision},
           "tie_word_embeddings": f.tie_word_embeddings, "dtype": dtype_name}  # fmt: skip
    out.update({k: v for k, v in dataclasses.asdict(cfg.vision_token_ids).items() if v is not None})
    return out


def qwen25_vl_to_hf(cfg: Any, dtype: torch.dtype) -> dict[str, Any]:
    """Loong ModelConfig -> config.json that transformers reads as Qwen2.5-VL."""
    f, e, tps = cfg.foundation, cfg.image_encoder, cfg.tokens_per_second
    vision = {
        "depth": e.num_layers, "hidden_size": e.hidden_size,
        "intermediate_size": e.ffn_hidden_size, "num_heads": e.num_attention_heads, "hidden_act": "silu",
        "in_channels": e.in_channels, "patch_size": e.patch_size, "temporal_patch_size": e.temporal_patch_size,
        "spatial_merge_size": e.spatial_merge_size, "window_size": e.window_size,
        "fullatt_block_indexes": list(e.fullatt_block_indexes), "out_hidden_size": f.hidden_size,
        "rope_parameters": {"rope_theta": e.rotary_base, "rope_type": "axial"},
        "initializer_range": e.init_method_std,
        # an int in transformers' (strict) vision config
        "tokens_per_second": int(tps) if float(tps).is_integer() else tps,
    }  # fmt: skip
    return composed_hf_config(cfg, dtype, arch="Qwen2_5_VLForConditionalGeneration", model_type="qwen2_5_vl",
                              rope={"mrope_section": list(f.mrope_section)}, vision=vision)  # fmt: skip


def same_composed(a: Any, b: Any, encoder_arch: tuple[str, ...], projector_arch: tuple[str, ...],
                  model_keys: tuple[str, ...]) -> bool:  # fmt: skip
    """Two VLM configs describe the same architecture: foundation (multimodal RoPE included), the
    listed encoder / projector fields and model-level keys."""

    def fields(c: Any, names: tuple[str, ...]) -> dict[str, Any]:
        d = dataclasses.asdict(c)
        return {k: d.get(k) for k in names}

    fa, fb = a.foundation, b.foundation
    return (
        same_architecture(fa, fb)
        and (fa.mrope_section, fa.mrope_interleaved) == (fb.mrope_section, fb.mrope_interleaved)
        and same_value(fields(a.image_encoder, encoder_arch), fields(b.image_encoder, encoder_arch))
        and same_value(fields(a.image_projector, projector_arch), fields(b.image_projector, projector_arch))
        and all(same_value(getattr(a, k, None), getattr(b, k, None)) for k in model_keys)
    )


def qwen25_vl_same(a: Any, b: Any) -> bool:
    return same_composed(a, b, _ENCODER_ARCH, _PROJECTOR_ARCH, (*_TOKEN_IDS, "tokens_per_second"))


QWEN25_VL = ModelMapping(
    name="qwen2.5-vl",
    hf_architectures=("Qwen2_5_VLForConditionalGeneration",),
    encoder_type=ENCODER_TYPE,
    components=(
        ComponentMapping(
            "image_encoder",
            "image_encoder.",
            {"hub": (("", "visual."),), "modules": (("", "model.visual."),)},
            rules=lambda cfg: QWEN25_VIT,
            shapes=_encoder_shapes,
        ),
        ComponentMapping(
            "image_projector",
            "image_projector.",
            {"hub": (("", "visual."),), "modules": (("", "model.visual."),)},
            rules=lambda cfg: QWEN25_MERGER,
            shapes=_projector_shapes,
        ),
        ComponentMapping(
            "foundation",
            "foundation.",
            {"hub": (), "modules": (("model.", "model.language_model."),)},
            rules=lambda cfg: get_mapping(cfg.foundation.family).rules,
            shapes=lambda cfg: cfg.foundation,
        ),
    ),
    namings={"hub": "model.embed_tokens.weight", "modules": "model.language_model.embed_tokens.weight"},
    from_hf=qwen25_vl_from_hf,
    to_hf=qwen25_vl_to_hf,
    same_architecture=qwen25_vl_same,
)
