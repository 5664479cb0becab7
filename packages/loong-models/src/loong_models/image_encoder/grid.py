"""Geometry of a packed batch of images and video clips described by ``grid_thw`` (one row
``(t, h, w)`` per image / clip, in patches): patch coordinates, attention segments, windows.

Patches of one item come in the image processor's order: frame by frame, and within a frame in
merge blocks (``merge x merge`` neighbouring patches consecutively, blocks in raster order).
Everything here is integer bookkeeping on the host (grids are tiny: pass them on the host, since
reading a device tensor back waits for the device); results go to ``device`` without a sync.
"""

from __future__ import annotations

import torch

from loong_models.host import to_device


def _grids(grid_thw: torch.Tensor, merge: int) -> list[tuple[int, int, int]]:
    rows = [tuple(int(v) for v in r) for r in grid_thw.tolist()]
    for i, (t, h, w) in enumerate(rows):
        if t < 1 or h < 1 or w < 1 or h % merge or w % merge:
            raise ValueError(f"grid_thw[{i}]=({t}, {h}, {w}): sizes must be >= 1 and h, w multiples of "
                             f"spatial_merge_size={merge}")  # fmt: skip
    return rows


def num_patches(grid_thw: torch.Tensor) -> int:
    return int(grid_thw.prod(-1).sum()) if grid_thw.numel() else 0


def patch_coordinates(grid_thw: torch.Tensor, merge: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) of every patch in its frame, in input order: two int64 tensors [N]."""
    rows, cols = [], []
    for t, h, w in _grids(grid_thw, merge):
        # [h/m, w/m, m, m] -> row = block_row * m + r, col = block_col * m + c
        r = torch.arange(h).view(h // merge, 1, merge, 1).expand(-1, w // merge, -1, merge)
        c = torch.arange(w).view(1, w // merge, 1, merge).expand(h // merge, -1, merge, -1)
        rows.append(r.reshape(-1).repeat(t))
        cols.append(c.reshape(-1).repeat(t))
    return to_device(torch.cat(rows), device), to_device(torch.cat(cols), device)


def frame_cu_seqlens(grid_thw: torch.Tensor, device=None) -> tuple[torch.Tensor, int]:
    """Segment boundaries (int32) with one segment per frame (HF Qwen2.5-VL attends per temporal
    patch, also for video), and the longest segment."""
    lens = [h * w for t, h, w in grid_thw.tolist() for _ in range(int(t))]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return to_device(cu, device), max(lens)


def window_partition(
    grid_thw: torch.Tensor, merge: int, window: int, device=None
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Reorder merge blocks so that each attention window is contiguous.

    ``window`` is the window side in merge blocks. Windows tile every frame from its top-left
    corner (edge windows are smaller), frames in order, windows in raster order, blocks in
    raster order inside a window (Qwen2.5-VL's layout). Returns ``order`` (block permutation:
    new position -> old block index), the windows' boundaries in patches (int32) and the largest.
    """
    order, lens, offset = [], [], 0
    for t, h, w in _grids(grid_thw, merge):
        bh, bw = h // merge, w // merge
        nwc = -(-bw // window)
        key = (torch.arange(bh) // window)[:, None] * nwc + (torch.arange(bw) // window)[None, :]
        key = key.reshape(-1)
        perm = torch.sort(key, stable=True).indices  # blocks of each window, raster order inside
        counts = torch.bincount(key)
        counts = counts[counts > 0] * merge * merge
        for f in range(t):
            order.append(perm + offset + f * bh * bw)
            lens.extend(counts.tolist())
        offset += t * bh * bw
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return to_device(torch.cat(order), device), to_device(cu, device), max(lens)
