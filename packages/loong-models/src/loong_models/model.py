"""A model is a composition of components; today a foundation LLM, later encoders and projectors
next to it (``image_encoder``, ``image_projector``) under the same ``model`` config node."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from megatron.core.transformer.transformer_config import TransformerConfig
from omegaconf import OmegaConf

from loong_models.foundation import FoundationConfig, build_foundation
from loong_models.lora import LoraConfig, apply_lora
from loong_models.specs import resolve_backend

CONFIG_DIR = Path(__file__).parent / "configs"


@dataclass
class ModelConfig:
    foundation: FoundationConfig = field(default_factory=FoundationConfig)
    # Which layer implementations to use: auto (TE on CUDA when installed, else local), te, local.
    layer_backend: str = "auto"
    # Low-rank adapters (null = off): freezes the adapted components' base weights.
    lora: LoraConfig | None = None


def zoo_names() -> list[str]:
    return sorted(p.stem for p in (CONFIG_DIR / "model").glob("*.yaml"))


def load_model_config(name: str, overrides: list[str] | None = None) -> ModelConfig:
    """Compose ``model=<name>`` from the zoo without the train app, e.g.
    ``load_model_config("qwen3-0.6b", ["foundation.num_layers=2"])``."""
    from hydra import compose, initialize_config_dir

    if name not in zoo_names():
        raise ValueError(f"model={name!r} is not in the zoo; available: {', '.join(zoo_names())}")
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        raw = compose(config_name=f"model/{name}", overrides=[f"model.{o}" for o in overrides or []])
    return to_model_config(raw.model)


def to_model_config(raw) -> ModelConfig:
    """Validate a composed ``model`` node against the schema (unknown keys and bad types raise,
    naming the key) and return the typed config."""
    merged = OmegaConf.merge(OmegaConf.structured(ModelConfig), raw)
    cfg: ModelConfig = OmegaConf.to_object(merged)
    cfg.foundation.validate()
    if cfg.lora is not None:
        cfg.lora.validate()
    return cfg


def build_model(
    cfg: ModelConfig,
    config: TransformerConfig,
    *,
    device_type: str,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: int | None = None,
):
    """Build this rank's pipeline stage of the model described by ``cfg`` (with its LoRA adapters)."""
    model = build_foundation(
        cfg.foundation,
        config,
        layer_backend=resolve_backend(cfg.layer_backend, device_type),
        pre_process=pre_process,
        post_process=post_process,
        vp_stage=vp_stage,
    )
    if cfg.lora is not None:
        apply_lora({"foundation": model}, cfg.lora)
    return model
