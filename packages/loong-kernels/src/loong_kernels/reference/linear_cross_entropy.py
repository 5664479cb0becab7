"""Linear + cross-entropy without the full ``[tokens, vocab]`` logits.

The tokens are processed in chunks; each chunk's logits live only while that chunk's loss and
gradients are computed, so peak memory is one chunk of logits instead of all of them. Gradients
are computed in the forward pass (the chunk's logits are gone by the backward) and scaled by
the incoming gradient in the backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loong_kernels.reference._precision import acc, acc_dtype

# A chunk of float32 logits (plus its softmax) takes about this many bytes; chosen so vocab 128K
# gives 512-token chunks, large enough for full-speed matmuls.
_CHUNK_LOGIT_BYTES = 256 * 2**20


def default_chunk_size(vocab: int) -> int:
    return max(1, _CHUNK_LOGIT_BYTES // (4 * vocab))


def linear_cross_entropy_unfused(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """The straightforward formula, materialising all logits (for tests and the benchmark)."""
    logits = hidden @ weight.t()
    return F.cross_entropy(acc(logits), target, ignore_index=ignore_index)


def linear_cross_entropy_chunked(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    chunk_size: int | None,
    need_grad_hidden: bool,
    need_grad_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Mean loss over non-ignored tokens and, if asked, its gradients w.r.t. hidden and weight.

    ``hidden`` is ``[tokens, dim]``, ``weight`` ``[vocab, dim]``, ``target`` ``[tokens]``.
    With every token ignored the loss is 0 (not NaN) and the gradients are zero, so an all-padding
    micro-batch does not poison training.
    """
    scale = mean_scale(target, ignore_index, acc_dtype(hidden))
    per_token, grad_hidden, grad_weight = linear_cross_entropy_tokens_chunked(
        hidden, weight, target, scale, chunk_size, need_grad_hidden, need_grad_weight
    )
    return (per_token * scale).sum(), grad_hidden, grad_weight


def mean_scale(target: torch.Tensor, ignore_index: int, dtype: torch.dtype) -> torch.Tensor:
    """Each token's weight in the mean over non-ignored tokens: 1 / count, 0 when ignored."""
    valid = target != ignore_index
    return valid.to(dtype) / max(int(valid.sum()), 1)


def linear_cross_entropy_tokens_chunked(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    scale: torch.Tensor,
    chunk_size: int | None,
    need_grad_hidden: bool,
    need_grad_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Each token's cross-entropy ``[tokens]`` and, if asked, the gradients of ``sum(scale * loss)``
    w.r.t. hidden and weight. A target outside ``[0, vocab)`` has no target logit (its loss is the
    logsumexp, as in megatron's vocab-parallel cross-entropy); give it scale 0 to ignore it."""
    n_tokens, vocab = hidden.shape[0], weight.shape[0]
    # at most the default: a chunk size chosen for the bf16 kernel (e.g. output_loss_chunk_tokens=8192)
    # would be 4 GiB of float32 logits here, and the autotuner runs this reference on the same call
    chunk = min(chunk_size or default_chunk_size(vocab), default_chunk_size(vocab))
    in_vocab = (target >= 0) & (target < vocab)
    safe_target = torch.where(in_vocab, target, 0)
    losses = torch.empty(n_tokens, dtype=acc_dtype(hidden), device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if need_grad_hidden else None
    # Accumulated in the weight's dtype: one matmul per chunk accumulates in float32 inside, and
    # a float32 buffer would cost as much as the whole weight again at vocab 128K.
    grad_weight = torch.zeros_like(weight) if need_grad_weight else None

    for start in range(0, n_tokens, chunk):
        h = hidden[start : start + chunk]
        t = safe_target[start : start + chunk, None]
        ok = in_vocab[start : start + chunk]
        logits = acc(h @ weight.t())
        lse = torch.logsumexp(logits, dim=-1)
        picked = logits.gather(1, t).squeeze(1)
        losses[start : start + chunk] = lse - torch.where(ok, picked, 0.0)
        if not (need_grad_hidden or need_grad_weight):
            continue
        # d(sum scale * loss)/d logits = (softmax - onehot) * scale; computed in place in the
        # logits buffer to keep one [chunk, vocab] float32 alive.
        dlogits = logits.sub_(lse[:, None]).exp_()
        dlogits.scatter_add_(1, t, -ok.to(logits.dtype)[:, None])
        dlogits.mul_(scale[start : start + chunk].to(logits.dtype)[:, None])
        dlogits = dlogits.to(hidden.dtype)
        if grad_hidden is not None:
            torch.matmul(dlogits, weight, out=grad_hidden[start : start + chunk])
        if grad_weight is not None:
            grad_weight.addmm_(dlogits.t(), h)
    return losses, grad_hidden, grad_weight
