"""LLM foundations: config schema, family registry and the megatron-core builder."""

from loong_models.foundation.build import build_foundation, build_transformer_config
from loong_models.foundation.config import FoundationConfig, RopeScaling
from loong_models.foundation.families import FAMILIES, Family, get_family
from loong_models.foundation.mla import MLAConfig, SparseAttentionConfig
from loong_models.foundation.moe import MoEConfig

__all__ = [
    "FAMILIES",
    "Family",
    "FoundationConfig",
    "MLAConfig",
    "MoEConfig",
    "RopeScaling",
    "SparseAttentionConfig",
    "build_foundation",
    "build_transformer_config",
    "get_family",
]
