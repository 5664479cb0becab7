"""loong-models: the model zoo, as YAML-composed components built on megatron-core."""

from loong_models.diffusion import WanConfig, WanModel, build_wan_transformer_config
from loong_models.diffusion.towers import TextEncoderConfig, VaeConfig
from loong_models.foundation import (
    FAMILIES,
    FoundationConfig,
    RopeScaling,
    build_foundation,
    build_transformer_config,
    get_family,
)
from loong_models.image_encoder import ENCODER_TYPES, ImageEncoder, ImageEncoderConfig
from loong_models.image_projector import ImageProjector, ImageProjectorConfig
from loong_models.lora import LoraConfig, apply_lora
from loong_models.model import (
    ModelConfig,
    build_model,
    encoder_tensor_parallel_size,
    load_model_config,
    to_model_config,
    zoo_names,
)
from loong_models.omni import OmniCombinationModel, VisionTokenIds, mrope_positions
from loong_models.packed_seq import packed_seq_params
from loong_models.specs import decoder_block_spec, fusion_fields, resolve_backend

__version__ = "0.1.0"
__all__ = [
    "ENCODER_TYPES",
    "FAMILIES",
    "FoundationConfig",
    "ImageEncoder",
    "ImageEncoderConfig",
    "ImageProjector",
    "ImageProjectorConfig",
    "LoraConfig",
    "ModelConfig",
    "OmniCombinationModel",
    "VisionTokenIds",
    "TextEncoderConfig",
    "VaeConfig",
    "WanConfig",
    "WanModel",
    "build_wan_transformer_config",
    "RopeScaling",
    "apply_lora",
    "build_foundation",
    "build_model",
    "build_transformer_config",
    "encoder_tensor_parallel_size",
    "decoder_block_spec",
    "fusion_fields",
    "get_family",
    "load_model_config",
    "mrope_positions",
    "packed_seq_params",
    "resolve_backend",
    "to_model_config",
    "zoo_names",
]
