"""FP8 linear + cross-entropy: the three GEMMs of :mod:`loong_kernels.tl.linear_cross_entropy` on
Hopper's FP8 tensor cores, the same TileLang softmax kernel between them.

Per call, the weight is quantised once to E4M3 in both layouts (one TileLang cast-transpose
pass): cuBLASLt's FP8 GEMMs read both operands along the reduced dimension, so the logits GEMM
takes ``W`` ``[vocab, dim]`` and the ``dh`` GEMM ``W.T``. Per chunk of tokens: the hidden states
are cast (and transposed, for ``dW``) to E4M3, ``logits = h @ W.T`` is one ``torch._scaled_mm``
with bf16 output, :func:`~loong_kernels.tl.linear_cross_entropy.build_ce`'s kernel turns them
into the logits' gradient in place, which is cast to E5M2 in both layouts (its bound, the
largest token weight, gives the one scale of every chunk:
:func:`~loong_kernels.reference.linear_cross_entropy_fp8.gradient_scale`), and ``dh = g @ W`` and
``dW += g.T @ h`` are two more FP8 GEMMs. Every cast is one float32 product and one rounding
(:mod:`loong_kernels.reference.fp8`), bit-identical to the reference's.
"""

import functools
from collections.abc import Callable
from typing import Any

import tilelang.language as T
import torch

from loong_kernels.reference.fp8 import E4M3, E5M2, abs_max, pow2_scale
from loong_kernels.reference.linear_cross_entropy_fp8 import gradient_scale
from loong_kernels.tl._common import compile_kernel, dtype_name
from loong_kernels.tl.linear_cross_entropy import build_ce, chunk_losses, target_index

# bf16 logits of one chunk: vocab 128K gives 4096-token chunks. Larger than the bf16 version's:
# each chunk writes a weight-sized dW part that is then added (an FP8 GEMM cannot accumulate)
_CHUNK_LOGIT_BYTES = 1024 * 2**20
_TILE = 64  # the cast-transpose kernel's square tile
# cuBLASLt's FP8 GEMMs need every dimension a multiple of 16
_ALIGN = 16
_FP8_NAMES = {E4M3: "float8_e4m3", E5M2: "float8_e5m2"}


def supports(hidden: torch.Tensor, weight: torch.Tensor, *rest: object) -> bool:
    """bf16 on a GPU with FP8 tensor cores (sm_89+), widths that cuBLASLt's FP8 GEMMs take."""
    return (
        hidden.dtype == weight.dtype == torch.bfloat16
        and hidden.is_cuda
        and weight.device == hidden.device
        and torch.cuda.get_device_capability(hidden.device) >= (8, 9)
        and hidden.shape[1] % _ALIGN == 0
        and weight.shape[0] % _ALIGN == 0
    )


def default_chunk_size(vocab: int) -> int:
    return max(128, _CHUNK_LOGIT_BYTES // (2 * vocab) // 128 * 128)


@functools.cache
def build_cast_transpose(cols: int, in_dtype: str, out_dtype: str, target: str = "auto") -> Any:
    """``Y = fp8(X * Scale)`` and ``YT = Y.T`` in one pass: each CTA casts a 64x64 tile (reads and
    writes along rows) and writes its transpose from shared memory (writes along columns)."""
    rows = T.dynamic("rows")

    @T.prim_func
    def cast_transpose_kernel(
        X: T.Tensor((rows, cols), in_dtype),
        Scale: T.Tensor((1,), "float32"),
        Y: T.Tensor((rows, cols), out_dtype),
        YT: T.Tensor((cols, rows), out_dtype),
    ):
        with T.Kernel(T.ceildiv(cols, _TILE), T.ceildiv(rows, _TILE), threads=256) as (bx, by):
            tile = T.alloc_shared((_TILE, _TILE), out_dtype)
            for i, j in T.Parallel(_TILE, _TILE):
                r, c = by * _TILE + i, bx * _TILE + j
                if r < rows and c < cols:
                    tile[i, j] = T.cast(T.cast(X[r, c], "float32") * Scale[0], out_dtype)
                    Y[r, c] = tile[i, j]
            for i, j in T.Parallel(_TILE, _TILE):
                c, r = bx * _TILE + i, by * _TILE + j
                if r < rows and c < cols:
                    YT[c, r] = tile[j, i]

    return compile_kernel(cast_transpose_kernel, target)


def tilelang_cast_transpose(x: torch.Tensor, scale: torch.Tensor, fmt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`loong_kernels.reference.fp8.cast_transpose` by :func:`build_cast_transpose`'s kernel."""
    rows, cols = x.shape
    q = torch.empty(rows, cols, dtype=fmt, device=x.device)
    qt = torch.empty(cols, rows, dtype=fmt, device=x.device)
    if x.numel():
        build_cast_transpose(cols, dtype_name(x.dtype), _FP8_NAMES[fmt])(x, scale.reshape(1).float(), q, qt)
    return q, qt


def linear_cross_entropy_tokens_fp8(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    scale: torch.Tensor,
    chunk_size: int | None,
    need_grad_hidden: bool,
    need_grad_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Same contract as :func:`loong_kernels.reference.linear_cross_entropy_fp8.linear_cross_entropy_tokens_fp8_chunked`."""
    kernel = build_ce(weight.shape[0], dtype_name(hidden.dtype), need_grad_hidden or need_grad_weight)
    args = (hidden, weight, target, scale, chunk_size, need_grad_hidden, need_grad_weight)
    return chunked_tokens_fp8_with(kernel, tilelang_cast_transpose, *args)


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` with zero (False) rows appended up to ``rows``."""
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_zeros((rows - x.shape[0], *x.shape[1:]))])


def chunked_tokens_fp8_with(
    kernel: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Any],
    cast_transpose: Callable[[torch.Tensor, torch.Tensor, torch.dtype], tuple[torch.Tensor, torch.Tensor]],
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    scale: torch.Tensor,
    chunk_size: int | None,
    need_grad_hidden: bool,
    need_grad_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The chunk loop around ``kernel(logits, scale, lse)`` (:func:`build_ce`'s contract) and
    ``cast_transpose`` (:func:`tilelang_cast_transpose`'s); the CPU tests pass torch versions."""
    n_tokens, vocab = hidden.shape[0], weight.shape[0]
    need_grad = need_grad_hidden or need_grad_weight
    # padding rows (zero hidden states, weight 0) keep every chunk a multiple of 16 tokens
    padded = -(-n_tokens // _ALIGN) * _ALIGN
    chunk = -(-min(chunk_size or default_chunk_size(vocab), max(padded, _ALIGN)) // _ALIGN) * _ALIGN
    h_all = _pad_rows(hidden, padded)
    in_vocab, index = (_pad_rows(x, padded) for x in target_index(target, vocab))
    scale = _pad_rows(scale.to(torch.float32), padded)
    s_h = pow2_scale(abs_max(h_all), E4M3)
    s_w = pow2_scale(abs_max(weight), E4M3)
    s_g = gradient_scale(scale)
    # the GEMMs take dequantisation scales (exact for the powers of two of h and W)
    dequant = {"h": (1 / s_h).reshape(()), "w": (1 / s_w).reshape(()), "g": (1 / s_g).reshape(())}
    w8, w8t = cast_transpose(weight, s_w, E4M3)
    losses = torch.empty(padded, dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty(padded, hidden.shape[1], dtype=hidden.dtype, device=hidden.device) if need_grad_hidden else None
    grad_weight = (torch.zeros_like if padded == 0 else torch.empty_like)(weight) if need_grad_weight else None
    logits = torch.empty(chunk, vocab, dtype=hidden.dtype, device=hidden.device)
    part = None
    lse = torch.empty(chunk, dtype=torch.float32, device=hidden.device)
    for start in range(0, padded, chunk):
        end = min(start + chunk, padded)
        # a fresh copy of the chunk's scales: TileLang checks kernel arguments' alignment
        sc, idx, ok = scale[start:end].clone(), index[start:end], in_vocab[start:end]
        lg, ls = logits[: end - start], lse[: end - start]
        h8, h8t = cast_transpose(h_all[start:end], s_h, E4M3)
        torch._scaled_mm(h8, w8.t(), dequant["h"], dequant["w"], out_dtype=lg.dtype, out=lg)
        losses[start:end] = chunk_losses(kernel, lg, sc, idx, ok, ls, need_grad)
        if not need_grad:
            continue
        g8, g8t = cast_transpose(lg, s_g, E5M2)
        if grad_hidden is not None:
            torch._scaled_mm(g8, w8t.t(), dequant["g"], dequant["w"], out_dtype=hidden.dtype, out=grad_hidden[start:end])
        if grad_weight is None:
            continue
        # cuBLASLt cannot add into its output: the first chunk writes dW, the others add a part
        if start == 0:
            torch._scaled_mm(g8t, h8t.t(), dequant["g"], dequant["h"], out_dtype=weight.dtype, out=grad_weight)
        else:
            part = part if part is not None else torch.empty_like(weight)
            torch._scaled_mm(g8t, h8t.t(), dequant["g"], dequant["h"], out_dtype=weight.dtype, out=part)
            grad_weight.add_(part)
    return losses[:n_tokens], None if grad_hidden is None else grad_hidden[:n_tokens], grad_weight

