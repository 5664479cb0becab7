"""What the autotuner runs for linear + cross-entropy (:data:`loong_kernels.dispatch.TUNED`): the
shape bucket a decision is kept for, and one run (loss and gradients) on the call's real inputs."""

from __future__ import annotations

from collections.abc import Callable

import torch

from loong_kernels.autotune import Step, token_bucket


def bucket(hidden: torch.Tensor, weight: torch.Tensor, *rest: object) -> tuple:
    """Tokens rounded up to a power of two; width, vocab and which gradients exactly. ``rest``: the
    other arguments of either form (mean or per-token), ending in the two gradient flags."""
    need_grad_hidden, need_grad_weight = rest[-2:]
    grads = "+".join(n for n, need in (("dh", need_grad_hidden), ("dW", need_grad_weight)) if need) or "none"
    return (token_bucket(hidden.shape[0]), f"D={hidden.shape[1]}", f"V={weight.shape[0]}", f"grads={grads}")


def trial(kernels: dict[str, Callable], *args: object) -> Step:
    """``[loss, dh, dW]`` (those asked for) of one run."""
    (fn,) = kernels.values()  # linear_cross_entropy or linear_cross_entropy_tokens
    return lambda: [x for x in fn(*args) if x is not None]
