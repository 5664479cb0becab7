"""Test helpers of loong-kernels: torch emulations of TileLang kernels, lane for lane, so the
code around a kernel (chunk loops, autograd) is tested on machines without a GPU."""

import math
from collections.abc import Callable

import torch

LOG2E, LN2 = 1.0 / math.log(2.0), math.log(2.0)


def emulated_ce_kernel(write_grad: bool) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]:
    """:func:`loong_kernels.tl.linear_cross_entropy.build_ce`'s kernel in torch, for the chunk
    loops' CPU tests: lane ``j`` of a CTA keeps its own running max and sum (base 2,
    float32) over entries ``j, j + TILE, ...``; the lanes are merged once at the end."""
    from loong_kernels.tl.linear_cross_entropy import _TILE as tile

    def run(logits: torch.Tensor, scale: torch.Tensor, lse: torch.Tensor) -> None:
        rows, vocab = logits.shape
        m = torch.full((rows, tile), float("-inf"))
        s = torch.zeros(rows, tile)
        for start in range(0, vocab, tile):
            width = min(tile, vocab - start)
            x = logits[:, start : start + width].float() * LOG2E
            new = torch.maximum(m[:, :width], x)
            s[:, :width] = s[:, :width] * torch.exp2(m[:, :width] - new) + torch.exp2(x - new)
            m[:, :width] = new
        m_row = m.max(1).values
        lse2 = m_row + torch.log2((s * torch.exp2(m - m_row[:, None])).sum(1))
        lse.copy_(lse2 * LN2)
        if write_grad:
            logits.copy_((torch.exp2(logits.float() * LOG2E - lse2[:, None]) * scale[:, None]).to(logits.dtype))

    return run
