"""Mappings of composed models (an image encoder + image projector + foundation LLM, ...).

A composed model's megatron checkpoint keys are those of its ``sharded_state_dict()``: each
component's own keys under the component's prefix (``image_encoder.``, ``foundation.``, ...). Its HF
tensor names are likewise per component under a prefix (``visual.``, ...). A
:class:`ComponentMapping` is one component's :class:`~loong_ckpt.mapping.Rule` s (the same rules
as a text family's) with those two prefixes; a :class:`ModelMapping` lists the components of one HF
architecture and how its config.json maps to a Loong ``ModelConfig``.

:func:`bind` turns either kind of model (a text family's FoundationConfig, or a composed
ModelConfig) into :class:`BoundRule` s: a rule with its full keys, HF names and the config its
transforms read. The converter, the online loader and the exporter work on bound rules only, so a
text-only model is simply the one-component case with empty prefixes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from loong_ckpt.composed import ComponentMapping, ModelMapping, Renames
from loong_ckpt.families import get_mapping, mtp_rules, supported_architectures
from loong_ckpt.hf_config import ConversionError, foundation_from_dict, from_hf_config
from loong_ckpt.mapping import Rule, SliceReader
from loong_ckpt.vlm import QWEN25_VL
from loong_ckpt.vlm_qwen3 import QWEN3_VL
from loong_models import FoundationConfig

__all__ = ["MODEL_MAPPINGS", "ComponentMapping", "ModelMapping", "Renames"]  # re-exported declarations

@dataclass(frozen=True)
class BoundRule:
    """One rule of one component, with the component's prefixes and the config its transforms read."""

    rule: Rule
    cfg: Any  # FoundationConfig, or a component's shapes (heads, head_dim, ...) for encoders
    mcore_prefix: str = ""
    hf_renames: Renames = ()
    component: str = "foundation"

    # The Rule interface (mapping.py), so that units / locate / the converter take bound rules as
    # they are. The ``cfg`` the callers pass (the foundation's) is ignored: the bound one is used.

    @property
    def mcore(self) -> str:
        return self.mcore_prefix + self.rule.mcore

    @property
    def aliases(self) -> tuple[str, ...]:
        return tuple(self.mcore_prefix + a for a in self.rule.aliases)

    @property
    def layered(self) -> bool:
        return self.rule.layered

    @property
    def expert(self) -> bool:
        return self.rule.expert

    @property
    def split(self):
        return self.rule.split

    @property
    def transform(self):
        return self.rule.transform

    @property
    def dtype(self) -> torch.dtype | None:
        return self.rule.dtype

    def applies(self, cfg: Any = None) -> bool:
        return self.rule.applies(self.cfg)

    def has_layer(self, cfg: Any, layer: int) -> bool:
        return self.rule.has_layer(self.cfg, layer)

    def hf_name(self, name: str) -> str:
        for old, new in self.hf_renames:
            if name.startswith(old):
                return new + name[len(old) :]
        return name

    def hf_names(self, layer: int | None, expert: int | None = None) -> list[str]:
        return [self.hf_name(n) for n in self.rule.hf_names(layer, expert)]

    def hf_shapes(self, mcore_shape: Sequence[int], cfg: Any = None) -> list[tuple[int, ...]]:
        return self.rule.hf_shapes(mcore_shape, self.cfg)

    def to_mcore(self, hf: Sequence[torch.Tensor], cfg: Any, padded_vocab: int) -> torch.Tensor:
        return self.rule.to_mcore(hf, self.cfg, padded_vocab)

    def to_hf(self, t: torch.Tensor, cfg: Any = None) -> list[torch.Tensor]:
        return self.rule.to_hf(t, self.cfg)

    def tp_shard(
        self, reader: SliceReader, layer: int | None, cfg: Any, tp_rank: int, tp_size: int, padded_vocab: int,
        expert: int | None = None,
    ) -> torch.Tensor:  # fmt: skip
        return self.rule.tp_shard(
            _RenamedReader(reader, self), layer, self.cfg, tp_rank, tp_size, padded_vocab, expert
        )


class _RenamedReader:
    """The rule asks for its own (unprefixed) HF names; the file holds the prefixed ones."""

    def __init__(self, reader: SliceReader, bound: BoundRule) -> None:
        self.reader, self.bound = reader, bound

    def shape(self, name: str) -> tuple[int, ...]:
        return self.reader.shape(self.bound.hf_name(name))

    def read(
        self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None
    ) -> torch.Tensor:
        return self.reader.read(self.bound.hf_name(name), dim, start, stop)


# The composed architectures, by name (declared in loong_ckpt.vlm; register() adds more).
MODEL_MAPPINGS: dict[str, ModelMapping] = {m.name: m for m in (QWEN25_VL, QWEN3_VL)}


def register(mapping: ModelMapping) -> ModelMapping:
    MODEL_MAPPINGS[mapping.name] = mapping
    return mapping


def composed_architectures() -> dict[str, ModelMapping]:
    return {arch: m for m in MODEL_MAPPINGS.values() for arch in m.hf_architectures}


def is_composed(cfg: Any) -> bool:
    """A Loong ModelConfig with more than a foundation (an image encoder, ...)."""
    return getattr(cfg, "image_encoder", None) is not None


def mapping_of(cfg: Any) -> ModelMapping:
    """The composed mapping of a ModelConfig (by the image encoder's type)."""
    for m in MODEL_MAPPINGS.values():
        if m.encoder_type == cfg.image_encoder.type:
            return m
    raise ConversionError(
        f"no HF mapping is declared for model.image_encoder.type={str(cfg.image_encoder.type)!r}; "
        f"types with one: {', '.join(m.encoder_type for m in MODEL_MAPPINGS.values())}"
    )


def foundation_of(cfg: Any) -> FoundationConfig:
    return cfg if isinstance(cfg, FoundationConfig) else cfg.foundation


# --- config.json <-> Loong config, for every kind of model ------------------------------------


def model_from_hf(hf: dict[str, Any], source: str = "config.json") -> Any:
    """The Loong config of an HF model: a FoundationConfig for a text family, a ModelConfig for a
    composed architecture. Unsupported architectures and features raise naming the key."""
    archs = hf.get("architectures") or []
    composed = composed_architectures()
    for arch in archs:
        if arch in composed:
            return composed[arch].from_hf(hf, source)
    if not any(a in supported_architectures() for a in archs):
        allowed = [*supported_architectures(), *composed]
        raise ConversionError(
            f"{source}: unsupported architecture {archs or hf.get('model_type')!r}; supported: {', '.join(allowed)}"
        )
    return from_hf_config(hf, source)


def model_to_hf(cfg: Any, dtype: torch.dtype, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """config.json of a Loong config; ``base`` (the source HF config) is kept when it still
    describes the same architecture, so HF -> Loong -> HF returns it unchanged."""
    from loong_ckpt.hf_config import to_hf_config

    if base is not None:  # Loong writes unquantised weights (an FP8 source is dequantised on load)
        base = {k: v for k, v in base.items() if k != "quantization_config"}
    if not is_composed(cfg):
        return to_hf_config(foundation_of(cfg), dtype, base)
    m = mapping_of(cfg)
    if base is not None:
        try:
            if m.same_architecture(model_from_hf(base), cfg):
                return dict(base)
        except (ConversionError, KeyError, TypeError, AttributeError):
            pass  # the stored config no longer describes this model: generate one
    return m.to_hf(cfg, dtype)


def same_model(a: Any, b: Any) -> bool:
    from loong_ckpt.hf_config import same_architecture

    if is_composed(a) != is_composed(b):
        return False
    if not is_composed(a):
        return same_architecture(foundation_of(a), foundation_of(b))
    return mapping_of(a).name == mapping_of(b).name and mapping_of(a).same_architecture(a, b)


# --- rules bound to a model -------------------------------------------------------------------


def bind_components(cfg: Any, naming: str | None = None) -> list[tuple[list[Rule | BoundRule], Any]]:
    """Per component, the rules the model of ``cfg`` has and the config that counts its layers /
    experts (``naming``: which HF naming of a composed architecture; its default is what
    transformers' save_pretrained writes). A text model: its family's own rules, unchanged."""
    if not is_composed(cfg):
        f = foundation_of(cfg)
        out = [([r for r in get_mapping(f.family).rules if r.applies(f)], f)]
        if f.mtp_num_layers:  # the MTP layers: a component counting mtp_num_layers layers
            try:
                out.append((mtp_rules(f), dataclasses.replace(f, num_layers=f.mtp_num_layers)))
            except ValueError as e:
                raise ConversionError(str(e)) from None
        return out
    m = mapping_of(cfg)
    naming = naming or next(iter(m.namings))
    out = []
    for comp in m.components:
        shapes = comp.shapes(cfg)
        rules = [BoundRule(r, shapes, comp.mcore_prefix, comp.hf_renames[naming], comp.component)
                 for r in comp.rules(cfg) if r.applies(shapes)]  # fmt: skip
        out.append((rules, shapes))
    return out


def bind(cfg: Any, naming: str | None = None) -> list[Rule | BoundRule]:
    """Every rule of the model of ``cfg``, all components together."""
    return [r for rules, _ in bind_components(cfg, naming) for r in rules]


def naming_of(cfg: Any, tensor_names: set[str], source: str) -> str | None:
    """The HF naming an HF directory uses (None for text-only models, which have one)."""
    return mapping_of(cfg).naming_of(tensor_names, source) if is_composed(cfg) else None


# --- loong.json -------------------------------------------------------------------------------

_COMPONENT_KEYS = ("image_encoder", "image_projector")


def checkpoint_meta(cfg: Any) -> dict[str, Any]:
    """What loong.json records of the model: ``foundation`` (as for text models), plus the other
    components and the model-level fields of a composed model under ``model``; a diffusion model
    records its ``model`` only (``model.diffusion``: its transformer, read by loong-convert)."""
    if getattr(cfg, "diffusion", None) is not None:
        return {"model": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "foundation"}}
    meta: dict[str, Any] = {"foundation": dataclasses.asdict(foundation_of(cfg))}
    if getattr(cfg, "embodied", None) is not None:  # a policy: its own config is the model
        return {"embodied": dataclasses.asdict(cfg.embodied)}
    if is_composed(cfg):
        model = dataclasses.asdict(cfg)
        model.pop("foundation")
        meta["model"] = model
    return meta


def config_from_meta(meta: dict[str, Any]) -> Any:
    """Inverse of :func:`checkpoint_meta` (a FoundationConfig when no composed model is recorded)."""
    if (meta.get("model") or {}).get("diffusion"):
        from omegaconf import OmegaConf

        from loong_models import ModelConfig

        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), meta["model"]))
    foundation = foundation_from_dict(meta["foundation"])
    model = meta.get("model")
    if not model or not model.get("image_encoder"):
        return foundation
    from omegaconf import OmegaConf

    from loong_models import ModelConfig

    raw = OmegaConf.merge(OmegaConf.structured(ModelConfig), {k: v for k, v in model.items()})
    cfg = OmegaConf.to_object(raw)
    cfg.foundation = foundation
    return cfg


# --- the Loong model YAML -----------------------------------------------------------------------

_RUNTIME_KNOBS = ("tensor_model_parallel_size", "freeze", "recompute", "extra")


def write_any_model_yaml(cfg: Any, configs_dir: Path, name: str) -> Path:
    """Hydra config group files for ``model=<name>``: ``configs/model/<name>.yaml`` and one file per
    component (``configs/model/<component>/<name>.yaml``), architecture fields only."""
    from omegaconf import OmegaConf

    from loong_ckpt.hf_config import ARCH_FIELDS, write_model_yaml

    model_yaml, found_yaml = write_model_yaml(foundation_of(cfg), configs_dir, name)
    if not is_composed(cfg):
        return model_yaml
    f = cfg.foundation
    fields = {k: v for k, v in dataclasses.asdict(f).items() if k in ARCH_FIELDS}
    fields.update(make_vocab_size_divisible_by=f.make_vocab_size_divisible_by, mrope_section=f.mrope_section,
                  mrope_interleaved=f.mrope_interleaved)  # fmt: skip
    found_yaml.write_text(f"# {name} (derived from its HF config.json)\n" + OmegaConf.to_yaml(fields))
    defaults = []
    for comp in _COMPONENT_KEYS:
        d = configs_dir / "model" / comp
        d.mkdir(parents=True, exist_ok=True)
        fields = {k: v for k, v in dataclasses.asdict(getattr(cfg, comp)).items() if k not in _RUNTIME_KNOBS}
        (d / f"{name}.yaml").write_text(
            f"# {name} {comp} (derived from its HF config.json)\n" + OmegaConf.to_yaml(fields)
        )
        defaults.append(f"  - {comp}: {name}\n")
    top = {
        k: v
        for k, v in dataclasses.asdict(cfg).items()
        if k not in (*_COMPONENT_KEYS, "foundation", "layer_backend")
    }
    model_yaml.write_text(
        f"# {name}: converted by loong-convert hf-to-mcore\ndefaults:\n{''.join(defaults)}  - foundation: {name}\n"
        f"  - _self_\n\n" + (OmegaConf.to_yaml(top) if top else "")
    )
    return model_yaml


def component_diff(a: Any, b: Any) -> str:
    """The architecture fields two model configs disagree on, as ``component.key: a (HF) != b``."""
    from loong_ckpt.hf_config import ARCH_FIELDS, same_value

    if is_composed(a) != is_composed(b):
        return f"image_encoder: {getattr(a, 'image_encoder', None)!r} (HF) != {getattr(b, 'image_encoder', None)!r}"
    diffs = []
    fa, fb = dataclasses.asdict(foundation_of(a)), dataclasses.asdict(foundation_of(b))
    diffs += [
        f"foundation.{k}: {fa[k]!r} (HF) != {fb[k]!r}"
        for k in (*ARCH_FIELDS, "mrope_section", "mrope_interleaved")
        if not same_value(fa[k], fb[k])
    ]
    if is_composed(a):
        for comp in _COMPONENT_KEYS:
            ca, cb = dataclasses.asdict(getattr(a, comp)), dataclasses.asdict(getattr(b, comp))
            diffs += [
                f"{comp}.{k}: {ca[k]!r} (HF) != {cb[k]!r}"
                for k in ca
                if k not in _RUNTIME_KNOBS and not same_value(ca[k], cb[k])
            ]
        ma, mb = dataclasses.asdict(a), dataclasses.asdict(b)
        skip = (*_COMPONENT_KEYS, "foundation", "layer_backend")
        diffs += [f"{k}: {ma[k]!r} (HF) != {mb[k]!r}" for k in ma if k not in skip and not same_value(ma[k], mb[k])]
    return "; ".join(diffs) or "head_dim / KV groups differ"

