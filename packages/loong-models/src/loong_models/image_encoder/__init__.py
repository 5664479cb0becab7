"""Image encoders (ViTs) for VLMs: config schema, encoder types and the megatron-core module."""

from loong_models.image_encoder.config import ENCODER_TYPES, EncoderType, ImageEncoderConfig, get_encoder_type
from loong_models.image_encoder.layers import VisionPackedSeqParams, WindowAttentionLayer
from loong_models.image_encoder.vit import ImageEncoder, build_encoder_transformer_config

__all__ = [
    "ENCODER_TYPES",
    "EncoderType",
    "ImageEncoder",
    "ImageEncoderConfig",
    "VisionPackedSeqParams",
    "WindowAttentionLayer",
    "build_encoder_transformer_config",
    "get_encoder_type",
]
