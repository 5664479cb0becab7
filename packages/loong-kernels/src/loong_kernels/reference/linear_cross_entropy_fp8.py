"""The FP8 linear + cross-entropy, emulated in float32: what its TileLang/cuBLASLt version computes.

Hidden states and weight are quantised tensorwise to E4M3, the gradient of the logits to E5M2
(:mod:`loong_kernels.reference.fp8`); every GEMM multiplies the dequantised values exactly and
accumulates in float32, as the FP8 tensor cores do. The logits and the logits' gradient are
rounded to the hidden states' dtype where the fast version stores them, so the two differ only
by the GEMMs' summation order.
"""

from __future__ import annotations

import torch

from loong_kernels.reference.fp8 import E4M3, E5M2, abs_max, pow2_scale, quantize
from loong_kernels.reference.linear_cross_entropy import default_chunk_size

# where the largest gradient entry lands: half E5M2's range, room for the rounding of p <= 1
GRADIENT_TARGET = 2.0**15


def dequantized(x: torch.Tensor, scale: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """float32 ``x`` after a round trip through ``fmt`` at ``scale``."""
    return quantize(x, scale, fmt).float() / scale


def gradient_scale(token_weight: torch.Tensor) -> torch.Tensor:
    """The E5M2 scale of the logits' gradient ``(softmax - onehot) * token_weight``: every entry
    lies within ``max |token_weight|``, which it maps to exactly ``2**15``. Not a power of two on
    purpose: at the targets the gradient is ``-(1 - p) * token_weight``, nearly the same value for
    every token of a mean loss, and a power-of-two scale would round all of them the same way
    (E5M2 steps are 25% apart: up to 12% too small or large, the whole gradient scaled with it).
    The products stay exactly rounded float32, so the kernels and this reference still agree bit
    for bit."""
    bound = abs_max(token_weight)
    return torch.where(bound > 0, GRADIENT_TARGET / bound.clamp(min=torch.finfo(torch.float32).tiny), 1.0)


def linear_cross_entropy_tokens_fp8_chunked(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    scale: torch.Tensor,
    chunk_size: int | None,
    need_grad_hidden: bool,
    need_grad_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Same contract as :func:`loong_kernels.reference.linear_cross_entropy.linear_cross_entropy_tokens_chunked`,
    with the three GEMMs in FP8 (tensorwise scales)."""
    n_tokens, vocab = hidden.shape[0], weight.shape[0]
    chunk = chunk_size or default_chunk_size(vocab)  # float32 logits, as the bf16 reference's
    in_vocab = (target >= 0) & (target < vocab)
    safe_target = torch.where(in_vocab, target, 0)
    h_scale = pow2_scale(abs_max(hidden), E4M3)
    w_scale = pow2_scale(abs_max(weight), E4M3)
    g_scale = gradient_scale(scale)
    w = dequantized(weight, w_scale, E4M3)
    losses = torch.empty(n_tokens, dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if need_grad_hidden else None
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_grad_weight else None
    for start in range(0, n_tokens, chunk):
        end = min(start + chunk, n_tokens)
        h = dequantized(hidden[start:end], h_scale, E4M3)
        t, ok = safe_target[start:end, None], in_vocab[start:end]
        # the FP8 GEMM writes the logits in the hidden states' dtype
        logits = (h @ w.t()).to(hidden.dtype).float()
        lse = torch.logsumexp(logits, dim=-1)
        picked = logits.gather(1, t).squeeze(1)
        losses[start:end] = lse - torch.where(ok, picked, 0.0)
        if not (need_grad_hidden or need_grad_weight):
            continue
        dlogits = torch.softmax(logits, dim=-1)
        dlogits.scatter_add_(1, t, -ok.float()[:, None])
        dlogits = (dlogits * scale[start:end].float()[:, None]).to(hidden.dtype)
        d = dequantized(dlogits, g_scale, E5M2)
        if grad_hidden is not None:
            grad_hidden[start:end] = (d @ w).to(hidden.dtype)
        if grad_weight is not None:
            grad_weight.addmm_(d.t(), h)
    return losses, grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype)
