"""Multimodal RoPE positions (Qwen2-VL / Qwen2.5-VL): three position ids per token (temporal,
height, width). Text tokens carry the same running index in all three; the tokens of an image
carry (start, start + row, start + column) of their merged patch, video tokens add the frame's
time (``frame * second_per_grid * tokens_per_second``) to the temporal id, and the text after a
vision item continues at ``start + max(rows, columns)`` (as HF transformers'
``Qwen2_5_VLModel.get_rope_index``). Positions restart at 0 in every packed document."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from loong_xpu.tokens import VisionTokenIds


def _vision_item(start: int, grid: tuple[int, int, int], merge: int, time_step: float) -> torch.Tensor:
    t, h, w = grid[0], grid[1] // merge, grid[2] // merge
    tt = (torch.arange(t) * time_step).long().view(t, 1, 1).expand(t, h, w)
    hh = torch.arange(h).view(1, h, 1).expand(t, h, w)
    ww = torch.arange(w).view(1, 1, w).expand(t, h, w)
    return torch.stack([tt, hh, ww]).reshape(3, -1) + start


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
    tokens = input_ids[0].tolist()
    s = len(tokens)
    bounds = [0, s] if cu_seqlens is None else [int(x) for x in cu_seqlens.tolist()]
    if bounds[0] != 0 or bounds[-1] != s:
        raise ValueError(f"cu_seqlens must run from 0 to {s}, got {bounds[0]}..{bounds[-1]}")
    m2 = spatial_merge_size**2
    grids: dict[int, Iterator] = {}
    if ids.image_token_id is not None:
        grids[ids.image_token_id] = iter([] if image_grid_thw is None else image_grid_thw.tolist())
    if ids.video_token_id is not None:
        grids[ids.video_token_id] = iter([] if video_grid_thw is None else video_grid_thw.tolist())
    seconds = iter([1.0] * (0 if video_grid_thw is None else len(video_grid_thw)) if second_per_grid_ts is None
                   else [float(x) for x in second_per_grid_ts])  # fmt: skip
    out = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        pos, i = 0, lo
        while i < hi:
            tok = tokens[i]
            j = i
            while j < hi and tokens[j] == tok:
                j += 1
            run = j - i  # a run of equal tokens: text, or one or more vision items of one kind
            if tok not in grids:
                out.append(torch.arange(pos, pos + run).expand(3, -1))
                pos += run
            else:
                kind = "image" if tok == ids.image_token_id else "video"
                while run > 0:
                    grid = next(grids[tok], None)
                    if grid is None:
                        raise ValueError(
                            f"more {kind} placeholder tokens than {kind}_grid_thw rows (at token {i})"
                        )
                    n = grid[0] * grid[1] * grid[2] // m2
                    if n > run:
                        raise ValueError(f"{kind} with grid {grid} needs {n} placeholder tokens, found a run of "
                                         f"{run} at token {i}")  # fmt: skip
                    step = tokens_per_second * next(seconds) if kind == "video" else 1.0
                    out.append(_vision_item(pos, grid, spatial_merge_size, step))
                    pos += max(grid[1], grid[2]) // spatial_merge_size
                    run -= n
                    i += n
            i = j
    for tok, it in grids.items():
        if next(it, None) is not None:
            kind = "image" if tok == ids.image_token_id else "video"
            raise ValueError(f"{kind}_grid_thw has more rows than {kind}s among the placeholder tokens")
    return torch.cat(out, dim=1)[:, None, :].to(input_ids.device)
