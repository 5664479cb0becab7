"""Linear + cross-entropy over token chunks as an autograd Function (no full logits).

The implementation (TileLang softmax kernel between cuBLAS GEMMs, or the chunked torch reference)
is measured once per shape bucket by the dispatcher."""

from __future__ import annotations

from typing import Any

import torch

from loong_kernels.dispatch import call_with, choose, choose_op
from loong_xpu.grad_scale import scale_by_device_scalar_


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


class LinearCrossEntropyTokensFunction(torch.autograd.Function):
    """Per-token losses whose gradients are computed in the forward, for an incoming gradient
    proportional to ``token_weight`` (``c * token_weight``, ``c`` a scalar found in the backward)."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        token_weight: torch.Tensor,
        chunk_size: int | None,
        grad_enabled: bool,
        fp8: bool,
    ) -> torch.Tensor:
        need = (grad_enabled and ctx.needs_input_grad[0], grad_enabled and ctx.needs_input_grad[1])
        args = (hidden, weight, target, token_weight, chunk_size, *need)
        if fp8:  # one fast version (no race): the reference is an emulation, for tests and other devices
            op = "linear_cross_entropy_tokens_fp8"
            impl = choose(op, *args)
        else:
            op = "linear_cross_entropy_tokens"
            impl = choose_op(op, *args)
        losses, dh, dw = call_with(impl, op, *args)
        ctx.save_for_backward(token_weight, *(g for g in (dh, dw) if g is not None))
        ctx.has = need
        return losses

    @staticmethod
    def backward(ctx: Any, dlosses: torch.Tensor) -> tuple[Any, ...]:
        if ctx.has is None:
            raise RuntimeError("linear_cross_entropy_per_token: backward ran twice (its gradients are used up)")
        token_weight, *saved = ctx.saved_tensors
        dh = saved.pop(0) if ctx.has[0] else None
        dw = saved.pop(0) if ctx.has[1] else None
        ctx.has = None
        c = _proportional_scale(dlosses.float(), token_weight.float())
        # dh and dW are the forward's (the logits are gone), scaled in place: no second weight-sized buffer
        # (one multi-tensor kernel: a 0-dim device tensor in mul_ takes TensorIterator's unvectorised path)
        scale_by_device_scalar_([g for g in (dh, dw) if g is not None], c)
        return dh, dw, None, None, None, None, None


def _proportional_scale(grad: torch.Tensor, token_weight: torch.Tensor) -> torch.Tensor:
    """The scalar ``c`` with ``grad == c * token_weight``; a gradient that is not proportional
    fails (asynchronously on a GPU: no host sync)."""
    c = (grad * token_weight).sum() / (token_weight * token_weight).sum().clamp(min=torch.finfo(torch.float32).tiny)
    err = (grad - c * token_weight).abs().max() if grad.numel() else grad.new_zeros(())
    bound = 1e-4 * (c.abs() * token_weight.abs().max() if grad.numel() else grad.new_zeros(())) + 1e-30
    torch._assert_async(
        err <= bound,
        "linear_cross_entropy_per_token: the gradient reaching the per-token losses is not proportional to "
        "token_weight (the losses must be reduced as sum(token_weight * loss) times one scale)",
    )
    return c


def linear_cross_entropy_per_token(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    token_weight: torch.Tensor,
    chunk_size: int | None = None,
    *,
    fp8: bool = False,
) -> torch.Tensor:
    """Each token's cross-entropy of ``hidden @ weight.T`` against ``target``, float32 ``[...]``
    (``target``'s shape), without the full logits.

    For training at the speed of the fused mean: the gradients are computed in the forward, for
    losses reduced as ``c * sum(token_weight * loss)`` (a loss mask, any scalar ``c`` such as
    1 / tokens or a loss scale), which is what the backward accepts (anything else fails). A
    target outside ``[0, vocab)`` has no target logit (megatron's convention); weight it 0.

    ``fp8=True``: the three GEMMs in FP8 with tensorwise power-of-two scales (hidden states and
    weight E4M3, the logits' gradient E5M2; :mod:`loong_kernels.tl.linear_cross_entropy_fp8`)
    on GPUs with FP8 tensor cores; elsewhere a float32 emulation of the same arithmetic runs.
    """
    h = hidden.reshape(-1, hidden.shape[-1])
    t = target.reshape(-1)
    w = token_weight.reshape(-1).to(torch.float32)
    if not h.shape[0] == t.shape[0] == w.shape[0]:
        raise ValueError(f"hidden has {h.shape[0]} tokens, target {t.shape[0]}, token_weight {w.shape[0]}")
    losses = LinearCrossEntropyTokensFunction.apply(h, weight, t, w, chunk_size, torch.is_grad_enabled(), fp8)
    return losses.view(target.shape)
