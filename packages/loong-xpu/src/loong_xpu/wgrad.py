"""Weight-gradient GEMMs that accumulate into ``main_grad``: the two functions of apex's
``fused_weight_gradient_mlp_cuda`` that megatron-core's own linears call with
``gradient_accumulation_fusion`` (``main_grad += grad_output^T @ input``), without apex.

On CUDA with Transformer Engine installed the accumulation is TE's cuBLAS GEMM with
``accumulate=True`` writing straight into the fp32 (or bf16) ``main_grad``: no bf16 weight
gradient is materialised and no separate add runs. Elsewhere (the CPU, a CUDA build without TE)
it is torch's ``addmm_`` in ``main_grad``'s dtype.
"""

from __future__ import annotations

import functools

import torch


def wgrad_gemm_accum_fp32(input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """``main_grad += grad_output^T @ input`` for an fp32 ``main_grad`` (``input``: [tokens, in],
    ``grad_output``: [tokens, out], ``main_grad``: [out, in])."""
    _accumulate(input, grad_output, main_grad)


def wgrad_gemm_accum_fp16(input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """The same for a bf16 / fp16 ``main_grad`` (``parallel.grad_reduce_in_fp32=false``)."""
    _accumulate(input, grad_output, main_grad)


def _accumulate(x: torch.Tensor, dy: torch.Tensor, main_grad: torch.Tensor) -> None:
    x, dy = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    gemm = _te_general_gemm() if main_grad.is_cuda else None
    if gemm is not None:
        # TE's wgrad call (its Linear's, with fuse_wgrad_accumulation): layout NT gives dy^T @ x
        gemm(x.contiguous(), dy.contiguous(), out_dtype=main_grad.dtype, accumulate=True, layout="NT",
             out=main_grad, grad=True)  # fmt: skip
        return
    dtype = main_grad.dtype  # bf16 operands upcast: their products are exact in fp32
    main_grad.addmm_(dy.t().to(dtype), x.to(dtype))


@functools.cache
def _te_general_gemm():
    try:
        from transformer_engine.pytorch.cpp_extensions import general_gemm
    except ImportError:
        return None
    return general_gemm
