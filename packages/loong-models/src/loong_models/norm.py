"""RMSNorm for megatron layer specs, computed by loong-kernels (fused TileLang kernel on CUDA,
torch reference elsewhere). Unlike megatron's torch-norm wrapper it supports sequence
parallelism: its weight is tagged so megatron all-reduces its gradient over the TP group."""

from __future__ import annotations

import functools
from collections.abc import Callable

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


def tp_replicated(norm: Callable[..., torch.nn.Module]) -> Callable[..., torch.nn.Module]:
    """``norm`` for an activation that every TP rank holds whole: MLA's query and KV latents.

    Without sequence parallelism such a norm's weight gradient is already complete and equal on
    every TP rank (the column-parallel projection after it all-reduces its input gradient). But
    megatron's ``finalize_model_grads`` sums every ``q_layernorm`` / ``k_layernorm`` gradient over
    TP whenever ``qk_layernorm`` is set (right for GQA's per-head norms, which see only the rank's
    heads), which would multiply MLA's query-latent norm gradient by the TP size. Its weights are
    tagged to be averaged over TP instead, which leaves equal gradients as they are; under
    sequence parallelism they keep the sum of the ranks' sequence parts."""
    return functools.partial(_build_tp_replicated, norm=norm)


def _build_tp_replicated(*, norm: Callable, config: TransformerConfig, **kwargs) -> torch.nn.Module:
    module = norm(config=config, **kwargs)
    if not config.sequence_parallel:
        for p in module.parameters():
            p.average_gradients_across_tp_domain = True
    return module
