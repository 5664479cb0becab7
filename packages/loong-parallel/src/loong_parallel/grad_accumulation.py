"""Batched gradient accumulation (``parallel.grad_accumulation=batched``): megatron's DDP adds each
parameter's gradient into its ``main_grad`` from a Python hook on the parameter's AccumulateGrad
node, one hook call and one add launch per parameter and micro-batch. Without those hooks the
gradients wait in ``param.grad`` and :func:`flush_grads` adds all of them into ``main_grad`` with
one multi-tensor add: after every micro-batch's backward (before the next forward) and before
megatron's gradient finalisation, so the sums and their rounding are the hooks' own.

Dropping megatron's hooks is a patch of megatron-core: it lives in loong_xpu's manifest
(``loong_xpu.grad_hooks``, the method it adds to ``DistributedDataParallel``); this module turns it
on for the config and runs the flushes in the step.

Only without ``parallel.overlap_grad_reduce`` (which starts bucket reductions from the hooks) and
without pipeline stages (whose schedules run several forwards before a backward)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from megatron.core.distributed import DistributedDataParallel

from loong_xpu.grad_hooks import METHOD, PARAMS_ATTR, TARGET, flush_grads

__all__ = ["batch_grad_accumulation", "batched", "flush_grads", "flushing_forward_step"]


def batch_grad_accumulation(chunk: DistributedDataParallel) -> None:
    """Drop megatron's per-parameter accumulation hooks of ``chunk`` (loong_xpu's patch)."""
    if chunk.ddp_config.overlap_grad_reduce:
        raise ValueError("parallel.grad_accumulation=batched cannot start bucket reductions during backward: "
                         "set parallel.overlap_grad_reduce=false")  # fmt: skip
    drop = getattr(chunk, METHOD, None)
    if drop is None:
        raise RuntimeError(f"parallel.grad_accumulation=batched needs loong_xpu's patch {TARGET}: "
                           "build the model inside loong_xpu.redirect_cuda")  # fmt: skip
    drop()


def batched(chunks: list[torch.nn.Module]) -> bool:
    return any(hasattr(c, PARAMS_ATTR) for c in chunks)


def flushing_forward_step(forward_step: Callable, chunks: list[torch.nn.Module]) -> Callable:
    """``forward_step`` that first flushes the previous micro-batch's gradients (megatron's
    schedules run each micro-batch's backward before the next forward without pipeline stages)."""

    @functools.wraps(forward_step)  # megatron reads the step function's signature
    def step(*args, **kwargs):
        flush_grads(chunks)
        return forward_step(*args, **kwargs)

    return step
