"""RMSNorm (optionally after a residual add) in plain torch, forward and backward.

Statistics are computed in float32 (float64 for float64 input), as the fused kernel does, so the
two agree to rounding of the output.
"""

from __future__ import annotations

import torch

from loong_kernels.reference._precision import acc


def rms_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(y, h, rstd)``: ``h = x + residual`` (or ``x``), ``y = h * rstd * weight``.

    ``x`` and ``residual`` are ``[rows, hidden]``; ``rstd`` is ``[rows]`` float32, kept for backward.
    """
    h = x if residual is None else x + residual
    hf = acc(h)
    rstd = torch.rsqrt(hf.pow(2).mean(-1) + eps)
    y = (hf * rstd[:, None] * acc(weight)).to(x.dtype)
    return y, h, rstd


def rms_norm_bwd(
    dy: torch.Tensor, dh_out: torch.Tensor | None, h: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients ``(dh, dweight)`` of ``y = h * rstd(h) * weight``.

    ``dh_out`` is the gradient flowing into the returned residual ``h`` (None when unused); it is
    added to ``dh`` because ``h`` feeds both the norm and the next residual add.
    """
    hf, dyf = acc(h), acc(dy)
    xhat = hf * rstd[:, None]
    g = dyf * acc(weight)
    # d/dh of h * rstd: rstd * (g - xhat * mean(g * xhat)), the usual RMSNorm backward
    dh = rstd[:, None] * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    if dh_out is not None:
        dh = dh + acc(dh_out)
    dweight = (dyf * xhat).sum(0)
    return dh.to(h.dtype), dweight.to(weight.dtype)
