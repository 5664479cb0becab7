"""Composition of components into one model (VLMs today)."""

from loong_models.omni.model import HOST_MEDIA_KEYS, MEDIA_KEYS, OmniCombinationModel
from loong_models.omni.mrope import VisionTokenIds, mrope_positions

__all__ = ["HOST_MEDIA_KEYS", "MEDIA_KEYS", "OmniCombinationModel", "VisionTokenIds", "mrope_positions"]
