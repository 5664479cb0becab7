"""A video's latent patch tokens and a context-parallel rank's share of them.

Tokens are the (frame, row, column) patches in raster order, each the ``patch volume x channels``
values the head predicts (channel last, as the head's output lays them out). Under context
parallelism (``parallel.cp``) rank ``r`` of ``cp`` holds the contiguous ``r``-th ``1/cp`` of every
sample's tokens: self-attention is bidirectional, so no load balancing (zigzag) is needed.
"""

from __future__ import annotations

import torch


def patch_tokens(video: torch.Tensor, patch_size: tuple[int, int, int]) -> torch.Tensor:
    """``[b, c, F, H, W]`` -> ``[b, tokens, pf * ph * pw * c]`` (the inverse of :func:`unpatchify`)."""
    (pf, ph, pw), (b, c, f, h, w) = patch_size, video.shape
    x = video.reshape(b, c, f // pf, pf, h // ph, ph, w // pw, pw)
    return x.permute(0, 2, 4, 6, 3, 5, 7, 1).reshape(b, -1, pf * ph * pw * c)


def unpatchify(tokens: torch.Tensor, patch_size: tuple[int, int, int], grid: tuple[int, int, int]) -> torch.Tensor:
    """``[b, tokens, pf * ph * pw * c]`` -> ``[b, c, F, H, W]`` for a ``grid`` of (f, h, w) patches."""
    (pf, ph, pw), (f, h, w), b = patch_size, grid, tokens.shape[0]
    x = tokens.reshape(b, f, h, w, pf, ph, pw, -1)
    return x.permute(0, 7, 1, 4, 2, 5, 3, 6).reshape(b, -1, f * pf, h * ph, w * pw)


def context_parallel_part(tokens: int, cp: int, rank: int, *, multiple: int = 1) -> slice:
    """The token positions rank ``rank`` of ``cp`` holds: a contiguous ``1/cp`` of the sample.
    ``multiple``: what each part must further divide by (the TP size under sequence parallelism)."""
    if tokens % (cp * multiple):
        sp = f" x parallel.tp={multiple} (sequence parallel)" if multiple > 1 else ""
        raise ValueError(f"parallel.cp={cp}{sp}: a sample's {tokens} latent tokens do not split into "
                         f"{cp * multiple} equal parts; choose latent sizes whose patch count divides")  # fmt: skip
    n = tokens // cp
    return slice(rank * n, (rank + 1) * n)
