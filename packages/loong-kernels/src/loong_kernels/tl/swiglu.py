"""SwiGLU in TileLang: ``[rows, 2F] -> [rows, F]`` tiles, math in float32."""

import functools
from typing import Any

import tilelang.language as T
import torch

from loong_kernels.tl._common import compile_kernel, dtype_name

_BLOCK_ROWS, _BLOCK_COLS, _THREADS = 32, 256, 256


def supports(x: torch.Tensor) -> bool:
    return (x.shape[-1] // 2) % 8 == 0


def supports_bwd(dy: torch.Tensor, x: torch.Tensor) -> bool:
    return supports(x)


@functools.cache
def build_fwd(width: int, dtype: str, target: str = "auto") -> Any:
    rows = T.dynamic("rows")

    @T.prim_func
    def swiglu_fwd_kernel(X: T.Tensor((rows, 2 * width), dtype), Y: T.Tensor((rows, width), dtype)):
        with T.Kernel(T.ceildiv(width, _BLOCK_COLS), T.ceildiv(rows, _BLOCK_ROWS), threads=_THREADS) as (bx, by):
            for i, j in T.Parallel(_BLOCK_ROWS, _BLOCK_COLS):
                r, c = by * _BLOCK_ROWS + i, bx * _BLOCK_COLS + j
                if r < rows and c < width:
                    gate = T.cast(X[r, c], "float32")
                    up = T.cast(X[r, width + c], "float32")
                    Y[r, c] = T.cast(gate * T.sigmoid(gate) * up, dtype)

    return compile_kernel(swiglu_fwd_kernel, target)


@functools.cache
def build_bwd(width: int, dtype: str, target: str = "auto") -> Any:
    rows = T.dynamic("rows")

    @T.prim_func
    def swiglu_bwd_kernel(
        DY: T.Tensor((rows, width), dtype), X: T.Tensor((rows, 2 * width), dtype), DX: T.Tensor((rows, 2 * width), dtype)
    ):
        with T.Kernel(T.ceildiv(width, _BLOCK_COLS), T.ceildiv(rows, _BLOCK_ROWS), threads=_THREADS) as (bx, by):
            for i, j in T.Parallel(_BLOCK_ROWS, _BLOCK_COLS):
                r, c = by * _BLOCK_ROWS + i, bx * _BLOCK_COLS + j
                if r < rows and c < width:
                    gate = T.cast(X[r, c], "float32")
                    up = T.cast(X[r, width + c], "float32")
                    dy = T.cast(DY[r, c], "float32")
                    sig = T.sigmoid(gate)
                    DX[r, c] = T.cast(dy * up * sig * (1.0 + gate * (1.0 - sig)), dtype)
                    DX[r, width + c] = T.cast(dy * gate * sig, dtype)

    return compile_kernel(swiglu_bwd_kernel, target)


def swiglu_fwd(x: torch.Tensor) -> torch.Tensor:
    rows, two_f = x.shape
    y = torch.empty(rows, two_f // 2, dtype=x.dtype, device=x.device)
    build_fwd(two_f // 2, dtype_name(x.dtype))(x, y)
    return y


def swiglu_bwd(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    dx = torch.empty_like(x)
    build_bwd(x.shape[1] // 2, dtype_name(x.dtype))(dy, x, dx)
    return dx
