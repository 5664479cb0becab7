"""Which tokens of a sequence a context-parallel rank holds: the load-balanced ("zigzag") layout.

Every sequence is cut into ``2 * cp`` equal chunks and rank ``r`` holds chunks ``r`` and
``2 * cp - 1 - r``. Under causal attention the early chunks are cheap and the late ones costly,
so each rank gets one of each and the work is even. This is megatron's layout
(``get_batch_on_this_cp_rank``, ``get_pos_emb_on_this_cp_rank``) and TE's for packed THD data
(``thd_get_partitioned_indices``: the same per sequence), so data split here feeds TE attention
and megatron's RoPE unchanged.
"""

from __future__ import annotations

import torch


def zigzag_positions(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Positions (int64) of the tokens of one ``seq_len``-token sequence on ``cp_rank``, in the
    order the rank holds them: chunk ``cp_rank``, then chunk ``2 * cp_size - 1 - cp_rank``."""
    if seq_len % (2 * cp_size):
        raise ValueError(
            f"sequence length {seq_len} must be divisible by 2 x parallel.cp = {2 * cp_size} "
            "(each sequence is cut into 2 x cp chunks)"
        )
    chunk = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    last = 2 * cp_size - 1 - cp_rank
    return torch.cat([first, torch.arange(last * chunk, (last + 1) * chunk)])


def packed_zigzag(cu_seqlens: list[int], cp_size: int, cp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For a packed (THD) sequence with full-length boundaries ``cu_seqlens``: the indices (into
    the packed tokens) this rank holds, and each held token's segment number. Every segment is
    split on its own, so its length must be divisible by ``2 * cp_size``."""
    index, segment = [], []
    for s, (lo, hi) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:])):
        pos = zigzag_positions(hi - lo, cp_size, cp_rank)
        index.append(lo + pos)
        segment.append(torch.full_like(pos, s))
    return torch.cat(index), torch.cat(segment)


def token_layout(
    local_len: int, cp_size: int, cp_rank: int, cu_seqlens: list[int] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(position within its sequence, segment number) of each token held by ``cp_rank``:
    what causal masking across ranks compares. ``cu_seqlens`` None: one unpacked sequence of
    ``local_len * cp_size`` tokens."""
    if cu_seqlens is None:
        pos = zigzag_positions(local_len * cp_size, cp_size, cp_rank)
        return pos, torch.zeros_like(pos)
    index, segment = packed_zigzag(cu_seqlens, cp_size, cp_rank)
    starts = torch.tensor(cu_seqlens[:-1], dtype=torch.long)
    return index - starts[segment], segment
