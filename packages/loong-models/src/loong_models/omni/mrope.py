"""Multimodal RoPE positions (Qwen2-VL / Qwen2.5-VL): three position ids per token (temporal,
height, width). Text tokens carry the same running index in all three; the tokens of an image
carry (start, start + row, start + column) of their merged patch, video tokens add the frame's
time (``frame * second_per_grid * tokens_per_second``) to the temporal id, and the text after a
vision item continues at ``start + max(rows, columns)`` (as HF transformers'
``Qwen2_5_VLModel.get_rope_index``). Positions restart at 0 in every packed document.

The forward step computes them on the host for every micro-batch, so the work is a handful of
tensor ops per pack plus one small op per vision item: the running index is a cumulative sum of
per-token advances (1 per text token, ``max(rows, columns)`` per vision item), not a Python walk
over the tokens (a pack of 4k tokens held ~250 text runs, each its own tensors)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from loong_models.host import repeat_per_segment
from loong_xpu.tokens import VisionTokenIds


def _vision_item(start: int, grid: tuple[int, int, int], merge: int, time_step: float) -> torch.Tensor:
    t, h, w = grid[0], grid[1] // merge, grid[2] // merge
    tt = (torch.arange(t) * time_step).long().view(t, 1, 1).expand(t, h, w)
    hh = torch.arange(h).view(1, h, 1).expand(t, h, w)
    ww = torch.arange(w).view(1, 1, w).expand(t, h, w)
    return torch.stack([tt, hh, ww]).reshape(3, -1) + start


def _vision_runs(
    tokens: torch.Tensor, bounds: list[int], vision_ids: list[int]
) -> list[tuple[int, int, int]]:
    """``(token id, start, length)`` of every maximal run of one vision token id inside one
    document, in order."""
    s = tokens.numel()
    change = torch.ones(s, dtype=torch.bool)
    change[1:] = tokens[1:] != tokens[:-1]
    firsts = torch.tensor([b for b in bounds[:-1] if b < s], dtype=torch.long)
    change[firsts] = True  # a run never crosses a document boundary
    starts = change.nonzero()[:, 0]
    ends = torch.cat([starts[1:], torch.tensor([s])])
    vision = torch.isin(tokens[starts], torch.tensor(vision_ids, dtype=tokens.dtype))
    return list(
        zip(tokens[starts][vision].tolist(), starts[vision].tolist(), (ends - starts)[vision].tolist())
    )


def mrope_positions(
    input_ids: torch.Tensor,
    ids: VisionTokenIds,
    *,
    spatial_merge_size: int,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    second_per_grid_ts: torch.Tensor | list[float] | None = None,
    tokens_per_second: float = 2.0,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """``input_ids [1, S]`` (one packed sequence; ``cu_seqlens`` its documents, or None for one)
    -> ``[3, 1, S]`` int64 positions. Images and videos are consumed in order of appearance."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be [1, S] (one packed sequence), got {tuple(input_ids.shape)}")
    tokens = input_ids[0].cpu()
    s = tokens.numel()
    bounds = [0, s] if cu_seqlens is None else [int(x) for x in cu_seqlens.tolist()]
    if bounds[0] != 0 or bounds[-1] != s:
        raise ValueError(f"cu_seqlens must run from 0 to {s}, got {bounds[0]}..{bounds[-1]}")
    grids: dict[int, Iterator] = {}
    if ids.image_token_id is not None:
        grids[ids.image_token_id] = iter([] if image_grid_thw is None else image_grid_thw.tolist())
    if ids.video_token_id is not None:
        grids[ids.video_token_id] = iter([] if video_grid_thw is None else video_grid_thw.tolist())
    seconds = iter([1.0] * (0 if video_grid_thw is None else len(video_grid_thw)) if second_per_grid_ts is None
                   else [float(x) for x in second_per_grid_ts])  # fmt: skip
    if s == 0:
        return torch.zeros(3, 1, 0, dtype=torch.long, device=input_ids.device)
    items = _vision_items(tokens, bounds, ids, grids, seconds, spatial_merge_size, tokens_per_second)
    for tok, it in grids.items():
        if next(it, None) is not None:
            kind = "image" if tok == ids.image_token_id else "video"
            raise ValueError(f"{kind}_grid_thw has more rows than {kind}s among the placeholder tokens")
    # advance of the running index at each token: 1 per text token; a vision item (its tokens are
    # all placeholders: the items cover every one) advances by max(rows, columns) at its last
    # token, so all its tokens see the index it starts at
    vision = torch.isin(tokens, torch.tensor(list(grids), dtype=tokens.dtype))
    advance = (~vision).long()
    last = torch.tensor([i + n - 1 for i, n, _, _ in items], dtype=torch.long)
    advance[last] = torch.tensor([span for _, _, span, _ in items], dtype=torch.long)
    running = advance.cumsum(0) - advance  # exclusive: the index before each token
    lengths = [hi - lo for lo, hi in zip(bounds[:-1], bounds[1:])]
    firsts = running[torch.tensor([min(lo, s - 1) for lo in bounds[:-1]], dtype=torch.long)].tolist()
    running -= repeat_per_segment(firsts, lengths)  # restart at 0 in every document
    out = running.expand(3, -1).clone()
    for i, n, _, offsets in items:
        out[:, i : i + n] += offsets
    return out[:, None, :].to(input_ids.device)


def _vision_items(tokens, bounds, ids, grids, seconds, merge, tokens_per_second):
    """``(start, tokens, advance, offsets [3, tokens])`` of every vision item, consuming the
    grids in order; the offsets of equal items are one tensor (computed once per call)."""
    m2 = merge**2
    items, made = [], {}
    for tok, i, run in _vision_runs(tokens, bounds, list(grids)):
        kind = "image" if tok == ids.image_token_id else "video"
        while run > 0:
            grid = next(grids[tok], None)
            if grid is None:
                raise ValueError(f"more {kind} placeholder tokens than {kind}_grid_thw rows (at token {i})")
            n = grid[0] * grid[1] * grid[2] // m2
            if n > run or n < 1:
                raise ValueError(f"{kind} with grid {grid} needs {n} placeholder tokens, found a run of "
                                 f"{run} at token {i}")  # fmt: skip
            step = tokens_per_second * next(seconds) if kind == "video" else 1.0
            key = (*grid, step)
            if key not in made:
                made[key] = _vision_item(0, grid, merge, step)
            items.append((i, n, max(grid[1], grid[2]) // merge, made[key]))
            run -= n
            i += n
    return items
