"""Core-attention modules that plug into megatron-core layer specs."""

from loong_models.attention.dsa import DSAttention, DSAttentionSubmodules
from loong_models.attention.indexer import LightningIndexer
from loong_models.attention.sdpa import SDPAttention

__all__ = ["DSAttention", "DSAttentionSubmodules", "LightningIndexer", "SDPAttention"]
