"""Tensorwise FP8 scaling with power-of-two scales, shared by the FP8 kernels and their references.

A tensor ``x`` is stored as ``q = fp8(x * s)`` and read back as ``q / s``, where ``s`` is the
largest power of two with ``amax(x) * s <= max(format)``. A power of two makes ``x * s`` exact in
any float format, so ``q`` is one round-to-nearest-even of ``x`` whichever device or kernel
computes it (the references and the TileLang kernels agree bit for bit), and ``1 / s`` is exact
as the dequantisation scale the FP8 GEMMs take.
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn  # activations and weights: 3 mantissa bits, max 448
E5M2 = torch.float8_e5m2  # gradients: 2 mantissa bits, max 57344, a wider range

# float32's exponents keep s and 1 / s normal and finite
_MIN_EXP, _MAX_EXP = -125, 125


def format_max(fmt: torch.dtype) -> float:
    return float(torch.finfo(fmt).max)


def abs_max(x: torch.Tensor) -> torch.Tensor:
    """float32 ``max |x|`` (0 for an empty tensor) without an ``|x|``-sized temporary."""
    if not x.numel():
        return torch.zeros((), dtype=torch.float32, device=x.device)
    lo, hi = torch.aminmax(x)
    return torch.maximum(hi.float(), -lo.float())


def pow2_scale(amax: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """The float32 scale ``s`` (a power of two) for a tensor whose largest magnitude is ``amax``;
    1 for an all-zero tensor. Stays on the device (no host sync)."""
    amax = amax.float()
    exponent = torch.floor(torch.log2(format_max(fmt) / amax.clamp(min=torch.finfo(torch.float32).tiny)))
    return torch.where(amax > 0, torch.exp2(exponent.clamp(_MIN_EXP, _MAX_EXP)), torch.ones_like(amax))


def quantize(x: torch.Tensor, scale: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """``fp8(float32(x) * scale)``: one float32 product (exact for a power-of-two scale), then
    one round-to-nearest-even, the same on every device."""
    return (x.float() * scale).to(fmt)


def cast_transpose(x: torch.Tensor, scale: torch.Tensor, fmt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize(x)`` ``[rows, cols]`` and its contiguous transpose ``[cols, rows]``: the two
    layouts FP8 GEMMs need (cuBLASLt reads both operands along the reduced dimension)."""
    q = quantize(x, scale, fmt)
    return q, q.t().contiguous()
