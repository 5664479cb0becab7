"""Shared helpers of the TileLang kernels: dtype names, targets, compilation.

Kernel modules here must not use ``from __future__ import annotations``: TileLang evaluates the
``T.Tensor((n, heads, ...))`` annotations of a prim_func, and string annotations lose the
builder's local variables.
"""

from __future__ import annotations

from typing import Any

import tilelang
import torch

from loong_kernels.tilelang_support import SM90_TARGET

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES[dtype]


def resolve_target(target: str) -> Any:
    """``"auto"`` (the GPU present) or ``"sm_90a"`` (compile-only, for machines without a GPU)."""
    if target == "auto":
        return "auto"
    if target == "sm_90a":
        return SM90_TARGET
    raise ValueError(f"unknown target {target!r}; allowed: auto, sm_90a")


def compile_kernel(func: Any, target: str, out_idx: list[int] | None = None) -> Any:
    # gathers through index tensors cannot use TMA; plain cp.async/ld keeps them simple and legal
    pass_configs = {
        tilelang.PassConfigKey.TL_DISABLE_TMA_LOWER: True,
        tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
    }
    return tilelang.compile(func, out_idx=out_idx, target=resolve_target(target), pass_configs=pass_configs)
