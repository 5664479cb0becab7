"""RMSNorm (+ optional residual add) as an autograd Function."""

from __future__ import annotations

from typing import Any

import torch

from loong_kernels.dispatch import call


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        y, h, rstd = call("rms_norm_fwd", x, weight, residual, eps)
        # an unused residual output then arrives as None instead of a materialised zero tensor
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(h, weight, rstd)
        ctx.has_residual = residual is not None
        return y, h

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor, dh_out: torch.Tensor | None) -> tuple[Any, ...]:
        h, weight, rstd = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros_like(h)
        dh, dweight = call("rms_norm_bwd", dy.contiguous(), dh_out, h, weight, rstd)
        return dh, dweight, (dh if ctx.has_residual else None), None


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``y = h / rms(h) * weight`` with ``h = x + residual`` (or ``x``) over the last dim.

    Returns ``(y, h)``: ``h`` is the new residual stream when ``residual`` is given (pre-norm
    blocks add it to the sublayer output next), else None.
    """
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous()
    r2 = None if residual is None else residual.reshape(-1, shape[-1]).contiguous()
    y, h = RMSNormFunction.apply(x2, weight, r2, eps)
    return y.view(shape), (h.view(shape) if residual is not None else None)
