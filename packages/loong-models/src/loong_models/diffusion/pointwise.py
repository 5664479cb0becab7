"""The pointwise parts of a Wan layer: fp32 LayerNorm + adaLN modulation, gated residuals, q/k
RMSNorm and the 3-D RoPE rotation, eager or fused by ``torch.compile`` (``diffusion.fuse_pointwise``).

Eager, each is a chain of fp32 kernels over [tokens, hidden] (a cast, the norm, a multiply, an
add, a cast back, ...) and the backward saves most intermediates; at Wan's 32,760 tokens those
memory-bound kernels cost about as much as the layer's matmuls. Compiled, each function is one
kernel forward and one backward, with the same fp32 math.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def modulate(x: torch.Tensor, eps: float, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``LayerNorm(x) * (1 + scale) + shift`` in fp32 (no affine), cast back to x's dtype."""
    h = F.layer_norm(x.float(), (x.shape[-1],), None, None, eps)
    return (h * (1 + scale) + shift).to(x.dtype)


def affine_norm(x: torch.Tensor, eps: float, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """An affine LayerNorm in fp32 (Wan's FP32LayerNorm), cast back to x's dtype."""
    return F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps).to(x.dtype)


def gated_residual(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``x + y * gate`` in fp32, cast back to x's dtype."""
    return (x.float() + y.float() * gate).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension in fp32 (the q/k norm when one rank holds all heads)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) / x.shape[-1] + eps)
    return (y * weight.float()).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved channel pairs (Wan / diffusers layout). x: [s, b, h, d]; cos, sin:
    [s, 1, 1, d/2] in float."""
    xf = x.float().unflatten(-1, (-1, 2))
    x1, x2 = xf[..., 0], xf[..., 1]
    out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.flatten(-2).to(x.dtype)


@dataclass(frozen=True)
class Pointwise:
    """The functions a Wan layer calls, eager or compiled (one set per model)."""

    modulate: Callable[..., torch.Tensor] = modulate
    affine_norm: Callable[..., torch.Tensor] = affine_norm
    gated_residual: Callable[..., torch.Tensor] = gated_residual
    rms_norm: Callable[..., torch.Tensor] = rms_norm
    rope: Callable[..., torch.Tensor] = apply_rope

    @classmethod
    def build(cls, fuse: bool) -> Pointwise:
        """Eager functions, or each compiled (static shapes: a model trains on few latent shapes)."""
        if not fuse:
            return cls()
        eager = cls()
        compiled = {
            name: torch.compile(getattr(eager, name), dynamic=False, fullgraph=True)
            for name in ("modulate", "affine_norm", "gated_residual", "rms_norm", "rope")
        }
        return cls(**compiled)
