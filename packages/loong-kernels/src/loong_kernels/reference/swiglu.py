"""SwiGLU in plain torch, Megatron's layout: the input's last dim is ``[gate | up]``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loong_kernels.reference._precision import acc


def swiglu_fwd(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` with ``gate, up = x.chunk(2, -1)``; computed in float32 (float64 for float64 input)."""
    gate, up = acc(x).chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def swiglu_bwd(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Gradient of :func:`swiglu_fwd` w.r.t. ``x`` (same layout as ``x``)."""
    gate, up = acc(x).chunk(2, dim=-1)
    dyf = acc(dy)
    sig = torch.sigmoid(gate)
    silu = gate * sig
    dgate = dyf * up * sig * (1 + gate * (1 - sig))
    dup = dyf * silu
    return torch.cat([dgate, dup], dim=-1).to(x.dtype)
