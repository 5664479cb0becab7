"""RMSNorm for megatron layer specs, computed by loong-kernels (fused TileLang kernel on CUDA,
torch reference elsewhere). Unlike megatron's torch-norm wrapper it supports sequence
parallelism: its weight is tagged so megatron all-reduces its gradient over the TP group."""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from loong_kernels import rms_norm


class RMSNorm(torch.nn.Module):
    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        # Under sequence parallelism each TP rank normalises a different slice of the sequence,
        # so the weight's gradient is partial: megatron sums tagged gradients across TP ranks.
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)[0]
