"""Linear + cross-entropy: cuBLAS GEMMs per token chunk, the softmax part in one TileLang kernel.

Per chunk of tokens: ``logits = h @ W.T`` (cuBLAS, bf16 out, fp32 accumulation; the chunk's
logits are the only ``[tokens, vocab]`` buffer ever allocated), then :func:`build_ce`'s kernel
does the softmax in two reads and one write of that buffer: one CTA per row runs an online
softmax over vocab tiles (every lane keeps its own running max and sum, so a tile costs no
cross-thread reduction; they are merged once at the end) and writes the row's logsumexp; then,
in place, ``softmax * scale`` (``scale`` = 1 / valid tokens, 0 on ignored rows) as bf16. A
one-element scatter per row subtracts ``scale`` at the target, which makes the buffer the
gradient of the mean loss w.r.t. the logits. The two gradient GEMMs (cuBLAS) read it:
``dh = dlogits @ W`` and ``dW += dlogits.T @ h``. Three GEMMs in all, as in the unfused formula, and no float32 copy of
the logits. Chunks are large (~512 MiB of bf16 logits) because every chunk reads and writes the
whole ``dW`` once.
"""

import functools
from collections.abc import Callable
from typing import Any

import tilelang.language as T
import torch

from loong_kernels.reference.linear_cross_entropy import mean_scale
from loong_kernels.tl._common import LN2, LOG2E, compile_kernel, dtype_name

_THREADS = 256
# vocab entries a CTA handles per step: 8 bf16 per thread, one 16-byte access each
_TILE = 2048
_CHUNK_LOGIT_BYTES = 512 * 2**20


def supports(hidden: torch.Tensor, weight: torch.Tensor, *rest: object) -> bool:
    """Both forms (mean or per-token). Rows of 16-byte aligned logits; the GEMMs are cuBLAS, so
    any hidden width works."""
    return weight.dtype == hidden.dtype and weight.shape[0] % 8 == 0 and weight.device == hidden.device


def default_chunk_size(vocab: int) -> int:
    return max(128, _CHUNK_LOGIT_BYTES // (2 * vocab) // 128 * 128)


@T.macro
def _online_update(L, row, start, width, m, s):  # noqa: ANN001, ANN202
    """Fold ``L[row, start : start + width]`` into the per-lane running max ``m`` and sum ``s``
    (base 2). Lanes past ``width`` are untouched."""
    for i, j in T.Parallel(1, _TILE):
        if j < width:
            x = T.cast(L[row, start + j], "float32") * LOG2E
            new_m = T.max(m[i, j], x)
            s[i, j] = s[i, j] * T.exp2(m[i, j] - new_m) + T.exp2(x - new_m)
            m[i, j] = new_m


@functools.cache
def build_ce(vocab: int, dtype: str, write_grad: bool, target: str = "auto") -> Any:
    """``Lse[r]`` (natural log) of each logits row; with ``write_grad`` the row becomes
    ``softmax * Scale[r]`` in place (the caller subtracts ``Scale[r]`` at the target: one entry a
    row, and a compare per entry here would keep the stores from being vectorised)."""
    rows = T.dynamic("rows")
    n_full, tail = divmod(vocab, _TILE)

    @T.prim_func
    def cross_entropy_kernel(
        L: T.Tensor((rows, vocab), dtype),
        Scale: T.Tensor((rows,), "float32"),
        Lse: T.Tensor((rows,), "float32"),
    ):
        with T.Kernel(rows, threads=_THREADS) as row:
            m = T.alloc_fragment((1, _TILE), "float32")
            s = T.alloc_fragment((1, _TILE), "float32")
            m_row = T.alloc_fragment((1,), "float32")
            s_row = T.alloc_fragment((1,), "float32")
            scale = T.alloc_fragment((1,), "float32")
            T.fill(m, -T.infinity("float32"))
            T.fill(s, 0)
            if n_full > 0:
                for vt in T.serial(n_full):
                    _online_update(L, row, vt * _TILE, _TILE, m, s)
            if tail > 0:
                _online_update(L, row, n_full * _TILE, tail, m, s)
            T.reduce_max(m, m_row, dim=1)
            # a lane that saw no entry has m = -inf and s = 0: it adds 0 * 0
            for i, j in T.Parallel(1, _TILE):
                s[i, j] = s[i, j] * T.exp2(m[i, j] - m_row[0])
            T.reduce_sum(s, s_row, dim=1)
            m_row[0] = m_row[0] + T.log2(s_row[0])  # the row's logsumexp, base 2
            Lse[row] = m_row[0] * LN2
            if write_grad:
                scale[0] = Scale[row]
                if n_full > 0:
                    for vt in T.serial(n_full):
                        _write_probs(L, row, vt * _TILE, _TILE, m_row, scale, dtype)
                if tail > 0:
                    _write_probs(L, row, n_full * _TILE, tail, m_row, scale, dtype)

    return compile_kernel(cross_entropy_kernel, target)


@T.macro
def _write_probs(L, row, start, width, lse2, scale, dtype):  # noqa: ANN001, ANN202
    """``L[row, start : start + width] = exp(L - lse) * scale`` with ``lse2`` in base 2."""
    for _i, j in T.Parallel(1, _TILE):
        if j < width:
            L[row, start + j] = T.cast(
                T.exp2(T.cast(L[row, start + j], "float32") * LOG2E - lse2[0]) * scale[0], dtype
            )


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    chunk_size: int | None,
    need_grad_hidden: bool,
    need_grad_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Same contract as :func:`loong_kernels.reference.linear_cross_entropy.linear_cross_entropy_chunked`."""
    need_grad = need_grad_hidden or need_grad_weight
    kernel = build_ce(weight.shape[0], dtype_name(hidden.dtype), need_grad)
    args = (hidden, weight, target, ignore_index, chunk_size, need_grad_hidden, need_grad_weight)
    return chunked_with(kernel, *args, overlap=OVERLAP)


def linear_cross_entropy_tokens(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    scale: torch.Tensor,
    chunk_size: int | None,
    need_grad_hidden: bool,
    need_grad_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Same contract as :func:`loong_kernels.reference.linear_cross_entropy.linear_cross_entropy_tokens_chunked`."""
    need_grad = need_grad_hidden or need_grad_weight
    kernel = build_ce(weight.shape[0], dtype_name(hidden.dtype), need_grad)
    args = (hidden, weight, target, scale, chunk_size, need_grad_hidden, need_grad_weight)
    return chunked_tokens_with(kernel, *args, overlap=OVERLAP)


# Whether a chunk's gradient GEMMs run on a side stream while the next chunk's logits and softmax
# kernel run (two logits buffers). Off until measured on a GPU (bench/kernels.py has both rows).
OVERLAP = False


def chunked_with(
    kernel: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Any],
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    chunk_size: int | None,
    need_grad_hidden: bool,
    need_grad_weight: bool,
    overlap: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The mean loss over non-ignored tokens from :func:`chunked_tokens_with` (the CPU tests pass
    a torch emulation of ``kernel``). ``overlap``: see :data:`OVERLAP` (CUDA only)."""
    scale = mean_scale(target, ignore_index, torch.float32)
    args = (hidden, weight, target, scale, chunk_size, need_grad_hidden, need_grad_weight)
    per_token, grad_hidden, grad_weight = chunked_tokens_with(kernel, *args, overlap=overlap)
    return (per_token * scale).sum(), grad_hidden, grad_weight


def chunked_tokens_with(
    kernel: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Any],
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    scale: torch.Tensor,
    chunk_size: int | None,
    need_grad_hidden: bool,
    need_grad_weight: bool,
    overlap: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The chunk loop around ``kernel(logits, scale, lse)`` (:func:`build_ce`'s contract): each
    token's loss and the gradients of ``sum(scale * loss)``. A target outside ``[0, vocab)`` has no
    target logit (its loss is the logsumexp, as in megatron's vocab-parallel cross-entropy)."""
    n_tokens, vocab = hidden.shape[0], weight.shape[0]
    chunk = min(chunk_size or default_chunk_size(vocab), max(n_tokens, 1))
    need_grad = need_grad_hidden or need_grad_weight
    in_vocab, index = target_index(target, vocab)
    scale = scale.to(torch.float32)
    losses = torch.empty(n_tokens, dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if need_grad_hidden else None
    # the first chunk's GEMM writes dW; zeros only for no tokens at all
    grad_weight = (
        (torch.zeros_like if n_tokens == 0 else torch.empty_like)(weight) if need_grad_weight else None
    )
    side = _SideStream(hidden.device) if overlap and need_grad and hidden.is_cuda else None
    buffers = [torch.empty(chunk, vocab, dtype=hidden.dtype, device=hidden.device) for _ in range(1 + bool(side))]
    lse = torch.empty(chunk, dtype=torch.float32, device=hidden.device)
    for i, start in enumerate(range(0, n_tokens, chunk)):
        end = min(start + chunk, n_tokens)
        # a fresh copy of the chunk's scales: TileLang checks kernel arguments' alignment
        h, sc, idx, ok = hidden[start:end], scale[start:end].clone(), index[start:end], in_vocab[start:end]
        lg, ls = buffers[i % len(buffers)][: end - start], lse[: end - start]
        if side is not None:
            side.release(i % len(buffers))  # its gradient GEMMs two chunks ago are done
        torch.mm(h, weight.t(), out=lg)
        losses[start:end] = chunk_losses(kernel, lg, sc, idx, ok, ls, need_grad)
        if not need_grad:
            continue
        gemms = functools.partial(_gradient_gemms, h, lg, weight, grad_hidden, grad_weight, start, end)
        if side is not None:
            side.run(gemms, i % len(buffers))
        else:
            gemms()
    if side is not None:
        side.join()
    return losses, grad_hidden, grad_weight


def target_index(target: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which tokens have a target logit, and the column each reads ``[tokens, 1]``: a row without a
    target reads column 0 (0 in its loss, its p0 * scale kept in the gradient)."""
    in_vocab = (target >= 0) & (target < vocab)
    return in_vocab, torch.where(in_vocab, target, 0).long()[:, None]


def chunk_losses(
    kernel: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Any],
    logits: torch.Tensor,
    scale: torch.Tensor,
    index: torch.Tensor,
    in_vocab: torch.Tensor,
    lse: torch.Tensor,
    write_grad: bool,
) -> torch.Tensor:
    """One chunk of logits through ``kernel`` (:func:`build_ce`'s, built with ``write_grad``): each
    token's loss, and with ``write_grad`` the logits turned in place into the gradient of
    ``sum(scale * loss)``."""
    picked = logits.gather(1, index).squeeze(1).float()
    kernel(logits, scale, lse)
    if write_grad:
        # the kernel left softmax * scale; the target's entry is (p - 1) * scale, from its float32 p
        logits.scatter_(1, index, ((torch.exp(picked - lse) - in_vocab.float()) * scale).to(logits.dtype)[:, None])
    return lse - torch.where(in_vocab, picked, 0.0)


class _SideStream:
    """Runs the gradient GEMMs of a chunk on a second CUDA stream, after the main stream has
    written that chunk's gradient logits; the main stream waits before it reuses the buffer."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device=device)
        self.done: dict[int, torch.cuda.Event] = {}

    def run(self, fn: Callable[[], None], buffer: int) -> None:
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            fn()
            self.done[buffer] = torch.cuda.Event()
            self.done[buffer].record(self.stream)

    def release(self, buffer: int) -> None:
        if buffer in self.done:
            torch.cuda.current_stream().wait_event(self.done.pop(buffer))

    def join(self) -> None:
        torch.cuda.current_stream().wait_stream(self.stream)


def _gradient_gemms(
    h: torch.Tensor,
    dlogits: torch.Tensor,
    weight: torch.Tensor,
    grad_hidden: torch.Tensor | None,
    grad_weight: torch.Tensor | None,
    start: int,
    end: int,
) -> None:
    if grad_hidden is not None:
        torch.mm(dlogits, weight, out=grad_hidden[start:end])
    if grad_weight is None:
        return
    # the first chunk writes dW, the others add to it (cuBLAS: float32 inside, one rounding each)
    if start == 0:
        torch.mm(dlogits.t(), h, out=grad_weight)
    else:
        grad_weight.addmm_(dlogits.t(), h)
