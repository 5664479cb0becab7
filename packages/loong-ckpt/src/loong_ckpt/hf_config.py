"""HF ``config.json`` <-> :class:`loong_models.FoundationConfig`, and the Loong model YAML."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from loong_ckpt.families import supported_architectures
from loong_models import FoundationConfig, RopeScaling, get_family
from loong_models.foundation import MLAConfig, MoEConfig, SparseAttentionConfig
from loong_models.foundation.config import ROPE_TYPE_FIELDS
from loong_models.precision import PrecisionConfig

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class ConversionError(ValueError):
    """Input that cannot be converted; the message names the file or key."""


def family_of(hf: dict[str, Any], source: str = "config.json") -> str:
    archs = hf.get("architectures") or []
    supported = supported_architectures()
    for arch in archs:
        if arch in supported:
            return supported[arch]
    raise ConversionError(
        f"{source}: unsupported architecture {archs or hf.get('model_type')!r}; supported: {', '.join(supported)}"
    )


def _rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from transformers 5 ``rope_parameters`` or v4 ``rope_theta``/``rope_scaling``."""
    params = dict(hf.get("rope_parameters") or {})
    theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = params or hf.get("rope_scaling") or None
    if scaling is not None:
        scaling = dict(scaling)
        kind = scaling.pop("rope_type", scaling.pop("type", "default"))
        scaling = None if kind == "default" else {"type": kind, **scaling}
    return float(theta), scaling


class _Keys:
    """Reads an HF config dict; ``need`` rejects values Loong cannot represent, naming the key."""

    def __init__(self, hf: dict[str, Any], source: str, family: str) -> None:
        self.hf, self.source, self.family = hf, source, family

    def get(self, *keys: str, default: Any = None) -> Any:
        for k in keys:
            if self.hf.get(k) is not None:
                return self.hf[k]
        return default

    def need(self, key: str, allowed: Any, default: Any = None, why: str = "") -> None:
        value = self.hf.get(key, default)
        if value != allowed:
            raise ConversionError(
                f"{self.source}: {key}={value!r} is not supported for {self.family}; allowed: {allowed!r}"
                + (f" ({why})" if why else "")
            )

    def fail(self, key: str, why: str) -> ConversionError:
        return ConversionError(
            f"{self.source}: {key}={self.hf.get(key)!r} is not supported for {self.family}: {why}"
        )


def _gqa_fields(k: _Keys) -> dict[str, Any]:
    heads = k.hf["num_attention_heads"]
    if "attention_bias" in k.hf:
        k.need("attention_bias", get_family(k.family).qkv_bias)
    return {"num_query_groups": k.get("num_key_value_heads", default=heads),
            "kv_channels": k.get("head_dim", default=k.hf["hidden_size"] // heads)}  # fmt: skip


def _mla_fields(k: _Keys) -> dict[str, Any]:
    k.need("attention_bias", False, False)
    # megatron's MLA rotates de-interleaved rope dims, which is HF's rope_interleave=True
    k.need("rope_interleave", True, True, "megatron's MLA applies RoPE to interleaved rope dims")
    if k.hf.get("q_lora_rank") is None:
        # the mapping has the rule (q_proj -> linear_q_proj), but loong_models builds MLA without a
        # query latent with the TE spec only, and conversion builds the local one
        raise k.fail("q_lora_rank", "MLA without a query latent builds in loong_models with the TE spec only")
    mla = MLAConfig(
        q_lora_rank=k.hf.get("q_lora_rank"),
        kv_lora_rank=k.hf["kv_lora_rank"],
        qk_head_dim=k.hf["qk_nope_head_dim"],
        qk_pos_emb_head_dim=k.hf["qk_rope_head_dim"],
        v_head_dim=k.hf["v_head_dim"],
    )
    return {"num_query_groups": None, "kv_channels": None, "mla": mla}


_ATTENTION_FROM_HF: dict[str, Callable[[_Keys], dict[str, Any]]] = {"gqa": _gqa_fields, "mla": _mla_fields}


def _qwen3_moe_from_hf(k: _Keys) -> MoEConfig:
    experts = k.get("num_experts", "num_local_experts")
    # megatron renormalises the top-k probabilities (softmax over the top-k logits)
    k.need("norm_topk_prob", True, False, "megatron's softmax router renormalises the top-k probabilities")
    n = k.hf["num_hidden_layers"]
    step, only = k.get("decoder_sparse_step", default=1), list(k.get("mlp_only_layers", default=[]))
    dense = [i for i in range(n) if i in only or (i + 1) % step != 0]
    if dense != list(range(len(dense))):
        raise k.fail(
            "mlp_only_layers",
            f"dense layers {dense} with decoder_sparse_step={step}; only the first k layers may be dense",
        )
    return MoEConfig(
        num_experts=experts, router_topk=k.hf["num_experts_per_tok"], ffn_hidden_size=k.hf["moe_intermediate_size"],
        first_k_dense=len(dense), score_function="softmax", load_balancing="aux_loss",
        aux_loss_coeff=float(k.get("router_aux_loss_coef", default=0.001)),
    )  # fmt: skip


def _deepseek_v3_moe_from_hf(k: _Keys) -> MoEConfig:
    k.need("norm_topk_prob", True, True, "megatron's sigmoid router always renormalises the top-k scores")
    k.need("scoring_func", "sigmoid", "sigmoid")
    k.need("topk_method", "noaux_tc", "noaux_tc")
    k.need("moe_layer_freq", 1, 1)
    topk, groups, group_topk = (
        k.hf["num_experts_per_tok"],
        k.get("n_group", default=1),
        k.get("topk_group", default=1),
    )
    if groups > 1 and topk // group_topk != 2:
        # HF ranks groups by the sum of their top-2 scores; megatron by the top (topk / group_topk)
        raise k.fail(
            "topk_group",
            f"num_experts_per_tok / topk_group must be 2 (got {topk} / {group_topk}) with n_group > 1",
        )
    moe_ffn, shared = k.hf["moe_intermediate_size"], k.get("n_shared_experts", default=0)
    return MoEConfig(
        num_experts=k.hf["n_routed_experts"], router_topk=topk, ffn_hidden_size=moe_ffn,
        shared_expert_intermediate_size=moe_ffn * shared if shared else None,
        first_k_dense=k.get("first_k_dense_replace", default=0), score_function="sigmoid",
        topk_scaling_factor=float(k.get("routed_scaling_factor", default=1.0)),
        num_groups=groups if groups > 1 else None, group_topk=group_topk if groups > 1 else None,
        # DeepSeek-V3's aux-loss-free balancing (expert bias) plus its small sequence-wise aux loss
        expert_bias=True, bias_update_rate=1e-3, load_balancing="seq_aux_loss", aux_loss_coeff=1e-4,
    )  # fmt: skip


def _deepseek_v32_moe_from_hf(k: _Keys) -> MoEConfig | None:
    """DeepSeek-V3's MoE, or none when every layer is dense (HF's mlp_layer_types, which defaults
    to first_k_dense_replace dense layers then MoE ones)."""
    n, first = k.hf["num_hidden_layers"], k.get("first_k_dense_replace", default=3)
    dense = min(first, n)
    types = k.get("mlp_layer_types", default=["dense"] * dense + ["sparse"] * (n - dense))
    dense = types.count("dense")
    if types != ["dense"] * dense + ["sparse"] * (n - dense):
        raise k.fail("mlp_layer_types", "only the first k layers may be dense")
    if dense == n:
        return None
    return dataclasses.replace(_deepseek_v3_moe_from_hf(k), first_k_dense=dense)


# HF config.json -> MoEConfig, per family (the HF key names differ between model types).
_MOE_FROM_HF: dict[str, Callable[[_Keys], MoEConfig | None]] = {
    "qwen3-moe": _qwen3_moe_from_hf,
    "deepseek-v3": _deepseek_v3_moe_from_hf,
    "deepseek-v32": _deepseek_v32_moe_from_hf,
}

# HF's DeepSeek-V3.2 indexer normalises its keys with LayerNorm(eps=1e-6) whatever rms_norm_eps
# says; Loong's uses the model's norm_epsilon.
_INDEXER_NORM_EPS = 1e-6


def _sparse_attention_fields(k: _Keys, rope_scaled: bool) -> dict[str, Any]:
    """DeepSeek sparse attention (the lightning indexer's sizes), and what Loong's cannot load."""
    eps = k.get("rms_norm_eps", default=1e-6)
    if not math.isclose(eps, _INDEXER_NORM_EPS, rel_tol=1e-6):
        raise k.fail(
            "rms_norm_eps",
            f"HF's indexer LayerNorm has eps {_INDEXER_NORM_EPS}, Loong's the model's norm eps",
        )
    if rope_scaled:  # loong_models' DSA applies plain RoPE (its indexer has no YaRN)
        raise k.fail("rope_parameters", "RoPE scaling (YaRN) with sparse attention is not supported yet")
    sparse = SparseAttentionConfig(index_n_heads=k.hf["index_n_heads"], index_head_dim=k.hf["index_head_dim"],
                                   index_topk=k.hf["index_topk"])  # fmt: skip
    return {"sparse_attention": sparse}


def from_hf_config(hf: dict[str, Any], source: str = "config.json") -> FoundationConfig:
    """The Loong foundation config of an HF model; unsupported features raise naming the key."""
    family = family_of(hf, source)
    fam = get_family(family)
    k = _Keys(hf, source, family)
    k.need("hidden_act", "silu", "silu")
    k.need("mlp_bias", False, False)
    k.need("use_sliding_window", False, False)
    theta, scaling = _rope(hf)
    rope_scaling = None
    if scaling is not None:
        allowed = "yarn" if fam.attention == "mla" else "llama3"
        if scaling.get("type") != allowed:
            raise ConversionError(
                f"{source}: rope type {scaling.get('type')!r} is not supported; allowed: {allowed}"
            )
        if allowed == "yarn" and (scaling.get("attention_factor") is not None or scaling.get("truncate", True) is not True
                                  or scaling.get("factor") is None):  # fmt: skip
            raise ConversionError(f"{source}: yarn RoPE needs 'factor' and megatron's defaults for 'attention_factor' "
                                  f"(derived from mscale / mscale_all_dim) and 'truncate' (true); got {scaling}")  # fmt: skip
        rope_scaling = RopeScaling(**{k: v for k, v in scaling.items() if k in _ROPE_FIELDS})
    moe = None
    if fam.moe != "never":
        if family not in _MOE_FROM_HF:
            raise ConversionError(f"{source}: no HF MoE config reader for family {family}")
        moe = _MOE_FROM_HF[family](k)
    cfg = FoundationConfig(
        family=family,
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=hf["num_attention_heads"],
        vocab_size=hf["vocab_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        rotary_base=theta,
        rope_scaling=rope_scaling,
        moe=moe,
        norm_epsilon=hf.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_method_std=hf.get("initializer_range", 0.02),
        mtp_num_layers=hf.get("num_nextn_predict_layers") or None,  # DeepSeek-V3's / V3.2's MTP layers
        **_ATTENTION_FROM_HF[fam.attention](k),
        **(_sparse_attention_fields(k, rope_scaling is not None) if fam.sparse_attention else {}),
    )
    try:
        cfg.validate()
    except ValueError as e:
        raise ConversionError(f"{source}: {e}") from None
    return cfg


_ROPE_FIELDS = {f.name for f in dataclasses.fields(RopeScaling)}
# The FoundationConfig fields an HF config determines (runtime knobs like recompute are not).
ARCH_FIELDS = (
    "family", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
    "kv_channels", "vocab_size", "max_position_embeddings", "rotary_base", "rope_scaling", "norm_epsilon",
    "tie_word_embeddings", "mla", "moe", "mtp_num_layers", "sparse_attention",
)  # fmt: skip
# The MoEConfig fields that are architecture (the rest are training knobs: balancing loss, capacity).
MOE_ARCH_FIELDS = (
    "num_experts", "router_topk", "ffn_hidden_size", "shared_expert_intermediate_size", "first_k_dense",
    "score_function", "topk_scaling_factor", "num_groups", "group_topk", "expert_bias",
)  # fmt: skip


_SPARSE_ARCH_FIELDS = ("index_n_heads", "index_head_dim", "index_topk")


def _arch_dict(c: FoundationConfig) -> dict[str, Any]:
    d = {k: v for k, v in dataclasses.asdict(c).items() if k in ARCH_FIELDS}
    d["num_query_groups"], d["kv_channels"] = c.query_groups, c.head_dim
    if c.moe is not None:
        d["moe"] = {k: getattr(c.moe, k) for k in MOE_ARCH_FIELDS}
    if c.sparse_attention is not None:  # indexer_loss_coeff is a training knob
        d["sparse_attention"] = {k: getattr(c.sparse_attention, k) for k in _SPARSE_ARCH_FIELDS}
    return d


def same_value(a: Any, b: Any) -> bool:
    """Equal, with floats equal to a relative 1e-6: ``norm_epsilon`` 1e-5 written by one tool reads
    back as 1.0000000000000001e-05 from another, and that is the same model."""
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, int | float) and isinstance(b, int | float) and math.isclose(a, b, rel_tol=1e-6)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    return a == b


def same_architecture(a: FoundationConfig, b: FoundationConfig) -> bool:
    return same_value(_arch_dict(a), _arch_dict(b))


def arch_diff(a: FoundationConfig, b: FoundationConfig) -> list[str]:
    """``key: a != b`` for each architecture field that differs."""
    da, db = _arch_dict(a), _arch_dict(b)
    return [f"{k}: {da[k]!r} != {db[k]!r}" for k in ARCH_FIELDS if not same_value(da[k], db[k])]


def to_hf_config(
    cfg: FoundationConfig, dtype: torch.dtype, base: dict[str, Any] | None = None
) -> dict[str, Any]:
    """config.json for ``cfg``. ``base`` (the HF config the weights came from, when known) is
    returned unchanged if it describes the same architecture, so HF -> Loong -> HF keeps it whole."""
    if base is not None:
        try:
            if same_architecture(from_hf_config(base), cfg):
                return dict(base)
        except (ConversionError, KeyError):
            pass  # the stored config no longer describes this model: generate one below
    fam = get_family(cfg.family)
    rope: dict[str, Any] = {"rope_theta": cfg.rotary_base, "rope_type": "default"}
    if cfg.rope_scaling is not None:
        rs = cfg.rope_scaling
        rope.update(rope_type=rs.type, **{k: getattr(rs, k) for k in ROPE_TYPE_FIELDS[rs.type]})
    out: dict[str, Any] = {
        "architectures": [fam.hf_architectures[0]],
        "model_type": fam.hf_model_type,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.norm_epsilon,
        "rope_parameters": rope,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": "silu",
        "initializer_range": cfg.init_method_std,
        "dtype": _DTYPE_NAMES.get(dtype, "float32"),
    }
    if cfg.mla is None:
        out.update(num_key_value_heads=cfg.query_groups, head_dim=cfg.head_dim)
        if fam.hf_model_type != "qwen2":  # Qwen2 has the bias built in, without a switch
            out["attention_bias"] = fam.qkv_bias
    else:
        m = cfg.mla
        out.update(
            num_key_value_heads=cfg.num_attention_heads, q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
            qk_nope_head_dim=m.qk_head_dim, qk_rope_head_dim=m.qk_pos_emb_head_dim, v_head_dim=m.v_head_dim,
            head_dim=m.qk_pos_emb_head_dim, rope_interleave=True, attention_bias=False,
        )  # fmt: skip
    if cfg.moe is not None:
        out.update(_MOE_TO_HF[cfg.family](cfg, cfg.moe))
    if cfg.sparse_attention is not None:
        out.update(_sparse_attention_to_hf(cfg, cfg.sparse_attention))
        del out["rope_interleave"]  # DeepseekV32Config has no such key: its MLA always interleaves
    return out


def _sparse_attention_to_hf(cfg: FoundationConfig, dsa: SparseAttentionConfig) -> dict[str, Any]:
    """DeepseekV32Config's indexer keys; a model without MoE is all dense layers."""
    if not math.isclose(cfg.norm_epsilon, _INDEXER_NORM_EPS, rel_tol=1e-6):
        raise ConversionError(f"model.foundation.norm_epsilon={cfg.norm_epsilon} cannot be written as an HF "
                              f"DeepseekV32 config: its indexer LayerNorm has eps {_INDEXER_NORM_EPS}")  # fmt: skip
    out = {
        "index_n_heads": dsa.index_n_heads,
        "index_head_dim": dsa.index_head_dim,
        "index_topk": dsa.index_topk,
    }
    if cfg.moe is None:
        out["first_k_dense_replace"] = cfg.num_layers
    if cfg.mtp_num_layers:  # the release's key; DeepseekV32Config keeps it as an extra attribute
        out["num_nextn_predict_layers"] = cfg.mtp_num_layers
    return out


def _qwen3_moe_to_hf(cfg: FoundationConfig, moe: MoEConfig) -> dict[str, Any]:
    _expressible(cfg, score_function="softmax", expert_bias=False, shared_expert_intermediate_size=None,
                 topk_scaling_factor=None, num_groups=None)  # fmt: skip
    return {
        "num_experts": moe.num_experts, "num_experts_per_tok": moe.router_topk,
        "moe_intermediate_size": moe.ffn_hidden_size, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": list(range(moe.first_k_dense)), "router_aux_loss_coef": moe.aux_loss_coeff,
    }  # fmt: skip


def _deepseek_v3_moe_to_hf(cfg: FoundationConfig, moe: MoEConfig) -> dict[str, Any]:
    _expressible(cfg, score_function="sigmoid", expert_bias=True)
    shared = moe.shared_expert_intermediate_size or 0
    if shared % moe.ffn_hidden_size:
        raise ConversionError(
            f"model.foundation.moe.shared_expert_intermediate_size={shared} is not a multiple of "
            f"moe.ffn_hidden_size={moe.ffn_hidden_size}: HF's DeepseekV3Config has n_shared_experts experts of that size"
        )
    groups = moe.num_groups or 1
    if groups > 1 and moe.router_topk // (moe.group_topk or 1) != 2:
        raise ConversionError(
            f"model.foundation.moe: router_topk / group_topk must be 2 for HF's DeepSeek-V3 group ranking "
            f"(got {moe.router_topk} / {moe.group_topk})"
        )
    return {
        "n_routed_experts": moe.num_experts, "num_experts_per_tok": moe.router_topk,
        "moe_intermediate_size": moe.ffn_hidden_size, "n_shared_experts": shared // moe.ffn_hidden_size,
        "first_k_dense_replace": moe.first_k_dense, "routed_scaling_factor": moe.topk_scaling_factor or 1.0,
        "n_group": groups, "topk_group": moe.group_topk or 1, "norm_topk_prob": True,
        "num_nextn_predict_layers": cfg.mtp_num_layers or 0,
    }  # fmt: skip


def _expressible(cfg: FoundationConfig, **required: Any) -> None:
    assert cfg.moe is not None
    for key, value in required.items():
        if getattr(cfg.moe, key) != value:
            raise ConversionError(
                f"model.foundation.moe.{key}={getattr(cfg.moe, key)!r} cannot be written as an HF "
                f"{get_family(cfg.family).hf_architectures[0]} config (it needs {value!r})"
            )


def _deepseek_v32_moe_to_hf(cfg: FoundationConfig, moe: MoEConfig) -> dict[str, Any]:
    out = _deepseek_v3_moe_to_hf(cfg, moe)
    del out["num_nextn_predict_layers"]  # written with the indexer's keys, only with MTP layers
    return out


# MoEConfig -> HF config.json keys, per family.
_MOE_TO_HF: dict[str, Callable[[FoundationConfig, MoEConfig], dict[str, Any]]] = {
    "qwen3-moe": _qwen3_moe_to_hf,
    "deepseek-v3": _deepseek_v3_moe_to_hf,
    "deepseek-v32": _deepseek_v32_moe_to_hf,
}


def model_name(path: str | Path) -> str:
    """A config-group-safe name from a directory name."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(path).resolve().name).strip("-.").lower()
    return name or "converted"


def write_model_yaml(cfg: FoundationConfig, configs_dir: Path, name: str) -> tuple[Path, Path]:
    """``configs/model/<name>.yaml`` + ``configs/model/foundation/<name>.yaml`` (Hydra config group
    files for ``hydra.searchpath=[file://<configs_dir>] model=<name>``)."""
    from omegaconf import OmegaConf

    model_dir = configs_dir / "model"
    (model_dir / "foundation").mkdir(parents=True, exist_ok=True)
    model_yaml = model_dir / f"{name}.yaml"
    model_yaml.write_text(
        f"# {name}: converted by loong-convert hf-to-mcore\ndefaults:\n  - foundation: {name}\n  - _self_\n"
    )
    # every moe: field, the training knobs (balancing loss, capacity) included: train reads this file
    fields = {k: v for k, v in dataclasses.asdict(cfg).items() if k in ARCH_FIELDS}
    fields["make_vocab_size_divisible_by"] = cfg.make_vocab_size_divisible_by
    found_yaml = model_dir / "foundation" / f"{name}.yaml"
    found_yaml.write_text(f"# {name} (derived from its HF config.json)\n" + OmegaConf.to_yaml(fields))
    return model_yaml, found_yaml


def foundation_to_dict(cfg: FoundationConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def foundation_from_dict(d: dict[str, Any]) -> FoundationConfig:
    d = dict(d)
    for key, cls in (
        ("rope_scaling", RopeScaling),
        ("mla", MLAConfig),
        ("moe", MoEConfig),
        ("sparse_attention", SparseAttentionConfig),
        ("precision", PrecisionConfig),
    ):
        if isinstance(d.get(key), dict):
            d[key] = cls(**d[key])
    names = {f.name for f in dataclasses.fields(FoundationConfig)}
    return FoundationConfig(**{k: v for k, v in d.items() if k in names})
