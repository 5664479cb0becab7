"""Diffusion transformers (Wan 2.x) on megatron-core: config, layers, model."""

from loong_models.diffusion.config import WanConfig
from loong_models.diffusion.embeddings import rope_3d, timestep_features
from loong_models.diffusion.flow_matching import (
    FlowMatchBatch,
    FlowMatching,
    FlowMatchingConfig,
    euler_sample,
    shifted_sigmas,
)
from loong_models.diffusion.wan import WanModel, build_wan_transformer_config

__all__ = [
    "FlowMatchBatch",
    "FlowMatching",
    "FlowMatchingConfig",
    "euler_sample",
    "shifted_sigmas","WanConfig", "WanModel", "build_wan_transformer_config", "rope_3d", "timestep_features"]
