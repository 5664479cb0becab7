"""Composition of components into one model (VLMs today)."""

from loong_models.omni.model import MEDIA_KEYS, OmniCombinationModel
from loong_models.omni.mrope import VisionTokenIds, mrope_positions

__all__ = ["MEDIA_KEYS", "OmniCombinationModel", "VisionTokenIds", "mrope_positions"]
