"""megatron-core's PackedSeqParams for a packed (THD) micro-batch."""

from __future__ import annotations

import torch
from megatron.core.packed_seq_params import PackedSeqParams


def packed_seq_params(cu_seqlens: torch.Tensor, max_seqlen: int) -> PackedSeqParams:
    """THD parameters for one packed sequence (the model input is ``[1, t]``).

    ``cu_seqlens`` must be int32 on the model's device and include every segment up to ``t``
    (padding is a segment of its own, see loong_data.collate_packed), so the padded and unpadded
    boundaries coincide and no ``*_padded`` fields are needed. ``max_seqlen`` is a Python int:
    TE and the RoPE table size use it without reading the device tensor.
    """
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
        raise ValueError(f"cu_seqlens must be a 1-D int32 tensor, got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=int(max_seqlen),
        max_seqlen_kv=int(max_seqlen),
    )
