"""SwiGLU as an autograd Function."""

from __future__ import annotations

from typing import Any

import torch

from loong_kernels.dispatch import call


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return call("swiglu_fwd", x)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return call("swiglu_bwd", dy.contiguous(), x)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` where ``gate, up = x.chunk(2, dim=-1)`` (Megatron's fc1 layout)."""
    if x.shape[-1] % 2:
        raise ValueError(f"swiglu needs an even last dim ([gate | up]), got {tuple(x.shape)}")
    shape = x.shape
    y = SwiGLUFunction.apply(x.reshape(-1, shape[-1]).contiguous())
    return y.view(*shape[:-1], shape[-1] // 2)
