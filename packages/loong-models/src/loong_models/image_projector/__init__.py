"""Image projectors: encoder features -> foundation tokens."""

from loong_models.image_projector.config import ImageProjectorConfig
from loong_models.image_projector.projector import ImageProjector, build_projector_transformer_config

__all__ = ["ImageProjector", "ImageProjectorConfig", "build_projector_transformer_config"]
