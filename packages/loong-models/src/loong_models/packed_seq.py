"""megatron-core's PackedSeqParams for a packed (THD) micro-batch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams


@dataclass
class HostPackedSeqParams(PackedSeqParams):
    """PackedSeqParams with the segment boundaries also on the host: ``bounds`` holds the values of
    ``cu_seqlens_q``. Whatever splits a pack by segment on the host (Loong's SDPAttention, the
    multimodal positions) reads them here instead of reading the device tensor back, which waits
    for every queued kernel. TE's attention takes only megatron's own fields."""

    bounds: tuple[int, ...] | None = None

    def segment_groups(self) -> dict[int, list[int]] | None:
        """:func:`segments_by_length` of ``bounds``, computed once: every layer of a block gets
        the same parameters (a ViT micro-batch: ~200 windows, grouped again by each of 32 layers)."""
        if self.bounds is None:
            return None
        cached = self.__dict__.get("_segment_groups")
        if cached is None or cached[0] is not self.bounds:  # computed for these bounds only
            cached = self.__dict__["_segment_groups"] = (self.bounds, segments_by_length(self.bounds))
        return cached[1]


def segments_by_length(bounds: Sequence[int]) -> dict[int, list[int]]:
    """Segment length -> the start of every (non-empty) segment of that length, in order."""
    groups: dict[int, list[int]] = {}
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if hi > lo:
            groups.setdefault(hi - lo, []).append(lo)
    return groups


def packed_seq_params(
    cu_seqlens: torch.Tensor, max_seqlen: int, bounds: Sequence[int] | None = None
) -> PackedSeqParams:
    """THD parameters for one packed sequence (the model input is ``[1, t]``).

    ``cu_seqlens`` must be int32 on the model's device and include every segment up to ``t``
    (padding is a segment of its own, see loong_data.collate_packed), so the padded and unpadded
    boundaries coincide and no ``*_padded`` fields are needed. ``max_seqlen`` is a Python int:
    TE and the RoPE table size use it without reading the device tensor. ``bounds``: the same
    boundaries on the host (e.g. the data's own copy of ``cu_seqlens``), see HostPackedSeqParams.
    """
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
        raise ValueError(
            f"cu_seqlens must be a 1-D int32 tensor, got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}"
        )
    return HostPackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=int(max_seqlen),
        max_seqlen_kv=int(max_seqlen),
        bounds=tuple(int(b) for b in bounds) if bounds is not None else None,
    )


def host_bounds(params: PackedSeqParams | None) -> tuple[int, ...] | None:
    """The host copy of a pack's segment boundaries, when its parameters carry one."""
    return getattr(params, "bounds", None)


def host_segment_groups(params: PackedSeqParams | None) -> dict[int, list[int]] | None:
    """The pack's segments grouped by length (cached on its parameters), when they carry ``bounds``."""
    return params.segment_groups() if isinstance(params, HostPackedSeqParams) else None
