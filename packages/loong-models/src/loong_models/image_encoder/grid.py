"""Geometry of a packed batch of images and video clips described by ``grid_thw`` (one row
``(t, h, w)`` per image / clip, in patches): patch coordinates, attention segments, windows.

Patches of one item come in the image processor's order: frame by frame, and within a frame in
merge blocks (``merge x merge`` neighbouring patches consecutively, blocks in raster order).
Everything here is integer bookkeeping on the host (grids are tiny: pass them on the host, since
reading a device tensor back waits for the device); results go to ``device`` without a sync.
"""

from __future__ import annotations

import itertools

import torch

from loong_models.host import repeat_per_segment, to_device


def _grids(grid_thw: torch.Tensor, merge: int) -> list[tuple[int, int, int]]:
    rows = [tuple(int(v) for v in r) for r in grid_thw.tolist()]
    for i, (t, h, w) in enumerate(rows):
        if t < 1 or h < 1 or w < 1 or h % merge or w % merge:
            raise ValueError(f"grid_thw[{i}]=({t}, {h}, {w}): sizes must be >= 1 and h, w multiples of "
                             f"spatial_merge_size={merge}")  # fmt: skip
    return rows


def _sizes(grids: list[tuple[int, int, int]]) -> dict[tuple[int, int], None]:
    """The distinct frame sizes ``(h, w)``, in order of appearance."""
    return dict.fromkeys((h, w) for _, h, w in grids)


def num_patches(grid_thw: torch.Tensor) -> int:
    return int(grid_thw.prod(-1).sum()) if grid_thw.numel() else 0


def _frame_coordinates(h: int, w: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    # [h/m, w/m, m, m] -> row = block_row * m + r, col = block_col * m + c
    r = torch.arange(h).view(h // merge, 1, merge, 1).expand(-1, w // merge, -1, merge)
    c = torch.arange(w).view(1, w // merge, 1, merge).expand(h // merge, -1, merge, -1)
    return r.reshape(-1), c.reshape(-1)


def patch_coordinates(grid_thw: torch.Tensor, merge: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) of every patch in its frame, in input order: two int64 tensors [N]. Each
    distinct frame size is laid out once and the frames concatenated (one op, not a few per image:
    a micro-batch holds tens of equal-sized images)."""
    grids = _grids(grid_thw, merge)
    frames = {(h, w): _frame_coordinates(h, w, merge) for h, w in _sizes(grids)}
    order = [frames[h, w] for t, h, w in grids for _ in range(t)]
    rows, cols = torch.cat([r for r, _ in order]), torch.cat([c for _, c in order])
    return to_device(rows, device), to_device(cols, device)


def _boundaries(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)


def frame_cu_seqlens(grid_thw: torch.Tensor, device=None) -> tuple[torch.Tensor, int]:
    """Segment boundaries (int32) with one segment per frame (HF Qwen2.5-VL attends per temporal
    patch, also for video), and the longest segment."""
    lens = [h * w for t, h, w in grid_thw.tolist() for _ in range(int(t))]
    return to_device(_boundaries(lens), device), max(lens)


def window_partition(
    grid_thw: torch.Tensor, merge: int, window: int, device=None
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Reorder merge blocks so that each attention window is contiguous.

    ``window`` is the window side in merge blocks. Windows tile every frame from its top-left
    corner (edge windows are smaller), frames in order, windows in raster order, blocks in
    raster order inside a window (Qwen2.5-VL's layout). Returns ``order`` (block permutation:
    new position -> old block index), the windows' boundaries in patches (int32) and the largest.
    """
    grids = _grids(grid_thw, merge)
    frames = {(h, w): _frame_windows(h // merge, w // merge, window) for h, w in _sizes(grids)}
    perms, starts, sizes, lens = [], [], [], []
    for t, h, w in grids:
        perm, counts = frames[h, w]
        for _ in range(t):
            starts.append(starts[-1] + sizes[-1] if perms else 0)
            perms.append(perm)
            sizes.append(len(perm))
            lens.extend(c * merge * merge for c in counts)
    # each frame's permutation shifted to its first block: a few ops for the whole micro-batch
    order = torch.cat(perms) + repeat_per_segment(starts, sizes)
    return to_device(order, device), to_device(_boundaries(lens), device), max(lens)


def _frame_windows(bh: int, bw: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """A frame of ``bh x bw`` merge blocks: the block permutation that makes each window
    contiguous, and the windows' sizes in blocks (raster order)."""
    nwc = -(-bw // window)
    key = (torch.arange(bh) // window)[:, None] * nwc + (torch.arange(bw) // window)[None, :]
    key = key.reshape(-1)
    perm = torch.sort(key, stable=True).indices  # blocks of each window, raster order inside
    counts = torch.bincount(key)
    return perm, counts[counts > 0].tolist()
