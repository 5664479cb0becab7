"""LoRA: low-rank adapters on megatron's tensor-parallel linears (see layers.py)."""

from loong_models.lora.config import DEFAULT_TARGETS, LoraConfig
from loong_models.lora.layers import ADAPTER_PARAMS, LoraError, apply_lora, is_adapter_key, lora_parameters

__all__ = [
    "ADAPTER_PARAMS",
    "DEFAULT_TARGETS",
    "LoraConfig",
    "LoraError",
    "apply_lora",
    "is_adapter_key",
    "lora_parameters",
]
