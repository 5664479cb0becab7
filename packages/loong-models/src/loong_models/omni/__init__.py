"""Composition of components into one model (VLMs today)."""

from loong_models.omni.model import OmniCombinationModel
from loong_models.omni.mrope import VisionTokenIds, mrope_positions

__all__ = ["OmniCombinationModel", "VisionTokenIds", "mrope_positions"]
