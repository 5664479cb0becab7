"""Core-attention modules that plug into megatron-core layer specs."""

from loong_models.attention.sdpa import SDPAttention

__all__ = ["SDPAttention"]
