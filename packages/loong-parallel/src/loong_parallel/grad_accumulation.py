"""Batched gradient accumulation (``parallel.grad_accumulation=batched``): megatron's DDP adds each
parameter's gradient into its ``main_grad`` from a Python hook on the parameter's AccumulateGrad
node, one hook call and one add launch per parameter and micro-batch (805 of each per step for
the full-shape Pi0.5, ~22 ms of host time in a host-bound step). Without those hooks autograd
leaves each gradient in ``param.grad`` (no copy: it takes the tensor the backward produced), and
:func:`flush_grads` adds all of them into ``main_grad`` with one multi-tensor add: after every
micro-batch's backward (before the next forward) and before megatron's gradient finalisation,
so the sums and their rounding are the hooks' own.

Only without ``parallel.overlap_grad_reduce`` (which starts bucket reductions from the hooks) and
without pipeline stages (whose schedules run several forwards before a backward)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from megatron.core.distributed import DistributedDataParallel

# the DDP-chunk attribute marking batched accumulation (its parameters that take gradients)
PARAMS_ATTR = "loong_batched_grad_params"


def batch_grad_accumulation(chunk: DistributedDataParallel) -> None:
    """Drop megatron's per-parameter accumulation hooks of ``chunk``: DDP keeps the only
    references to the hooked AccumulateGrad nodes (``grad_accs``; a parameter holds its node
    weakly), so autograd builds hook-free ones from the next forward on."""
    if chunk.ddp_config.overlap_grad_reduce:
        raise ValueError("parallel.grad_accumulation=batched cannot start bucket reductions during backward: "
                         "set parallel.overlap_grad_reduce=false")  # fmt: skip
    grad_accs = getattr(chunk, "grad_accs", None)
    if grad_accs is None:  # a megatron-core whose DDP keeps its hooks elsewhere
        raise RuntimeError("parallel.grad_accumulation=batched: megatron's DistributedDataParallel has no "
                           "grad_accs list of hooked gradient accumulators (megatron-core changed)")  # fmt: skip
    grad_accs.clear()
    setattr(chunk, PARAMS_ATTR, [p for p in chunk.module.parameters() if p.requires_grad])


def batched(chunks: list[torch.nn.Module]) -> bool:
    return any(hasattr(c, PARAMS_ATTR) for c in chunks)


@torch.no_grad()
def flush_grads(chunks: list[torch.nn.Module]) -> None:
    """Add every pending ``param.grad`` into its ``main_grad`` (one multi-tensor add) and drop it,
    as megatron's hook would have one by one; weights whose GEMM already accumulated into
    ``main_grad`` (``grad_added_to_main_grad``, TE's wgrad fusion) only drop theirs."""
    mains, grads = [], []
    for chunk in chunks:
        for p in getattr(chunk, PARAMS_ATTR, ()):
            # (megatron's fp32 optimizer points .grad at main_grad for its step)
            if p.grad is None or p.grad is p.main_grad:
                continue
            if not getattr(p, "grad_added_to_main_grad", False):
                mains.append(p.main_grad)
                grads.append(p.grad)
            p.grad = None
    if grads:
        torch._foreach_add_(mains, grads)


def flushing_forward_step(forward_step: Callable, chunks: list[torch.nn.Module]) -> Callable:
    """``forward_step`` that first flushes the previous micro-batch's gradients (megatron's
    schedules run each micro-batch's backward before the next forward without pipeline stages)."""

    @functools.wraps(forward_step)  # megatron reads the step function's signature
    def step(*args, **kwargs):
        flush_grads(chunks)
        return forward_step(*args, **kwargs)

    return step
