"""Linear + cross-entropy over token chunks as an autograd Function (no full logits).

The implementation (TileLang softmax kernel between cuBLAS GEMMs, or the chunked torch reference)
is measured once per shape bucket by the dispatcher."""

from __future__ import annotations

from typing import Any

import torch

from loong_kernels.dispatch import call_with, choose_op


class LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        ignore_index: int,
        chunk_size: int | None,
    ) -> torch.Tensor:
        # gradients are produced chunk by chunk here, while each chunk's logits exist
        args = (hidden, weight, target, ignore_index, chunk_size, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        loss, dh, dw = call_with(choose_op("linear_cross_entropy", *args), "linear_cross_entropy", *args)
        ctx.save_for_backward(*(g for g in (dh, dw) if g is not None))
        ctx.has = (dh is not None, dw is not None)
        return loss

    @staticmethod
    def backward(ctx: Any, dloss: torch.Tensor) -> tuple[Any, ...]:
        saved = list(ctx.saved_tensors)
        dh = saved.pop(0) if ctx.has[0] else None
        dw = saved.pop(0) if ctx.has[1] else None
        # the usual dloss is exactly 1: skipping the scaling avoids a second weight-sized buffer
        if not bool(dloss == 1):
            dh = None if dh is None else dh * dloss
            dw = None if dw is None else dw * dloss
        return dh, dw, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` against ``target`` over non-ignored tokens.

    ``hidden``: ``[..., dim]``, ``weight``: ``[vocab, dim]``, ``target``: ``[...]``. The logits
    are computed ``chunk_size`` tokens at a time (default: ~256 MiB of float32 logits per chunk)
    and never all at once. Returns a float32 scalar; 0 when every token is ignored.
    """
    h = hidden.reshape(-1, hidden.shape[-1])
    t = target.reshape(-1)
    if h.shape[0] != t.shape[0]:
        raise ValueError(f"hidden has {h.shape[0]} tokens but target has {t.shape[0]}")
    return LinearCrossEntropyFunction.apply(h, weight, t, ignore_index, chunk_size)
