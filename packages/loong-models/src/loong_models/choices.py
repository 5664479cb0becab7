"""Choices shared by several components' configs. As dataclass field types they are validated by
OmegaConf, whose error names the key and the allowed values; YAML spells them as their names."""

from __future__ import annotations

from enum import StrEnum


class Recompute(StrEnum):
    """Activation recomputation of a component (megatron's recompute_granularity); null = off."""

    selective = "selective"  # the submodules named by recompute_modules (megatron default: core_attn)
    full = "full"  # whole layers


class OutputLoss(StrEnum):
    """How a language model's output layer computes its loss (loong_models.foundation.output_loss)."""

    megatron = "megatron"  # logits, then megatron's vocab-parallel cross-entropy
    fused = "fused"  # linear + cross-entropy per token chunk (loong_kernels), no full logits


class Norm(StrEnum):
    """megatron's TransformerConfig.normalization."""

    RMSNorm = "RMSNorm"
    LayerNorm = "LayerNorm"


class Activation(StrEnum):
    """MLP activations of the vision components (functions in image_encoder/vit.py)."""

    gelu = "gelu"
    gelu_tanh = "gelu_tanh"
    silu = "silu"
