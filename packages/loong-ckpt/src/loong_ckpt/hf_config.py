"""HF ``config.json`` <-> :class:`loong_models.FoundationConfig`, and the Loong model YAML."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import torch

from loong_ckpt.families import supported_architectures
from loong_models import FoundationConfig, RopeScaling, get_family

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


def from_hf_config(hf: dict[str, Any], source: str = "config.json") -> FoundationConfig:
    """The Loong foundation config of an HF model; unsupported features raise naming the key."""
    family = family_of(hf, source)
    fam = get_family(family)

    def need(key: str, allowed: Any, default: Any = None) -> None:
        value = hf.get(key, default)
        if value != allowed:
            raise ConversionError(f"{source}: {key}={value!r} is not supported for {family}; allowed: {allowed!r}")

    need("hidden_act", "silu", "silu")
    need("mlp_bias", False, False)
    if "attention_bias" in hf:
        need("attention_bias", fam.qkv_bias)
    need("use_sliding_window", False, False)
    theta, scaling = _rope(hf)
    rope_scaling = None
    if scaling is not None:
        if scaling.get("type") != "llama3":
            raise ConversionError(f"{source}: rope type {scaling.get('type')!r} is not supported; allowed: llama3")
        rope_scaling = RopeScaling(**{k: v for k, v in scaling.items() if k in _ROPE_FIELDS})
    heads = hf["num_attention_heads"]
    cfg = FoundationConfig(
        family=family,
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads,
        vocab_size=hf["vocab_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        rotary_base=theta,
        rope_scaling=rope_scaling,
        norm_epsilon=hf.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_method_std=hf.get("initializer_range", 0.02),
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
    "tie_word_embeddings",
)  # fmt: skip


def same_architecture(a: FoundationConfig, b: FoundationConfig) -> bool:
    da, db = dataclasses.asdict(a), dataclasses.asdict(b)
    da["num_query_groups"], db["num_query_groups"] = a.query_groups, b.query_groups
    da["kv_channels"], db["kv_channels"] = a.head_dim, b.head_dim
    return all(da[k] == db[k] for k in ARCH_FIELDS)


def to_hf_config(cfg: FoundationConfig, dtype: torch.dtype, base: dict[str, Any] | None = None) -> dict[str, Any]:
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
        rs = dataclasses.asdict(cfg.rope_scaling)
        rope.update(rope_type=rs.pop("type"), **rs)
    out: dict[str, Any] = {
        "architectures": [fam.hf_architectures[0]],
        "model_type": fam.hf_model_type,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.query_groups,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.norm_epsilon,
        "rope_parameters": rope,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": "silu",
        "initializer_range": cfg.init_method_std,
        "dtype": _DTYPE_NAMES.get(dtype, "float32"),
    }
    if fam.hf_model_type != "qwen2":  # Qwen2 has the bias built in, without a switch
        out["attention_bias"] = fam.qkv_bias
    return out


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
    fields = {k: v for k, v in dataclasses.asdict(cfg).items() if k in ARCH_FIELDS}
    fields["make_vocab_size_divisible_by"] = cfg.make_vocab_size_divisible_by
    found_yaml = model_dir / "foundation" / f"{name}.yaml"
    found_yaml.write_text(f"# {name} (derived from its HF config.json)\n" + OmegaConf.to_yaml(fields))
    return model_yaml, found_yaml


def foundation_to_dict(cfg: FoundationConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def foundation_from_dict(d: dict[str, Any]) -> FoundationConfig:
    d = dict(d)
    if d.get("rope_scaling") is not None:
        d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    names = {f.name for f in dataclasses.fields(FoundationConfig)}
    return FoundationConfig(**{k: v for k, v in d.items() if k in names})
