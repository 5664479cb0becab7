"""megatron-core's TileLang DSA kernels (sparse MLA, fused indexer top-k) behind Loong's kernel signatures, so that the
dispatcher can race them against Loong's own (``megatron-core>=0.19`` ships them in
``megatron.core.transformer.experimental_attention_variant.ops``; imported only when chosen).

What the adapter bridges: megatron's kernels take a KV-group dim (``[T, 1, d_qk]`` KV and
``[T, 1, K]`` indices), return the LSE in base 2 and set it to 0 for a query with no selected
key; Loong's LSE is the natural log and ``-inf`` there, with ``out`` and ``dq`` zero.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from loong_kernels._log import logger

_D_QK, _D_V = 576, 512  # the only widths megatron-core's forward / backward are specialised for


@functools.cache
def _ops() -> Any | None:
    try:
        from megatron.core.transformer.experimental_attention_variant.ops import sparse_mla
    except Exception as e:  # megatron-core absent, or its tilelang import failed
        logger.info("megatron-core's sparse MLA kernels do not import (%s)", e)
        return None
    return sparse_mla if sparse_mla.HAVE_TILELANG_SPARSE_MLA else None


def blocker(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, d_v: int, scale: float) -> str | None:
    """Why megatron-core's sparse MLA cannot run ``sparse_mla_fwd``'s arguments, or None."""
    heads = q.shape[1]
    if q.dtype != torch.bfloat16 or kv.dtype != torch.bfloat16:
        return f"megatron-core's sparse MLA is bfloat16 only, got {q.dtype}"
    if q.shape[2] != _D_QK or d_v != _D_V:
        return f"megatron-core's sparse MLA needs d_qk={_D_QK}, d_v={_D_V}; got {q.shape[2]}, {d_v}"
    if heads < 16 or heads & (heads - 1):
        return f"megatron-core's sparse MLA needs a power-of-two head count >= 16, got {heads}"
    if q.shape[0] != kv.shape[0]:
        return f"megatron-core's sparse MLA takes as many keys as queries, got {kv.shape[0]} and {q.shape[0]}"
    if _ops() is None:
        return "megatron-core's TileLang sparse MLA does not import"
    return None


def blocker_bwd(q, kv, out, dout, indices, lse, d_v: int, scale: float) -> str | None:  # noqa: ANN001
    return blocker(q, kv, indices, d_v, scale)


def _grouped(kv: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """KV and indices with megatron's KV-group dim of 1."""
    return kv.unsqueeze(1).contiguous(), indices.to(torch.int32).unsqueeze(1).contiguous()


def sparse_mla_fwd(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, d_v: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`loong_kernels.reference.dsa.sparse_mla_fwd`."""
    kv3, idx3 = _grouped(kv, indices)
    out, lse2 = _ops().sparse_mla_fwd_interface(q.contiguous(), kv3, idx3, sm_scale=scale, d_v=d_v)
    valid = (indices >= 0).any(-1)
    out = torch.where(valid[:, None, None], out, 0)
    lse = torch.where(valid[:, None], lse2 * math.log(2.0), float("-inf"))
    return out, lse


def sparse_mla_bwd(q, kv, out, dout, indices, lse, d_v: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """As :func:`loong_kernels.reference.dsa.sparse_mla_bwd` (megatron's backward has ``d_v`` fixed at 512)."""
    kv3, idx3 = _grouped(kv, indices)
    lse2 = torch.where(torch.isinf(lse), 0.0, lse / math.log(2.0)).contiguous()
    dq, dkv = _ops().sparse_mla_bwd(q.contiguous(), kv3, out.contiguous(), dout.contiguous(), idx3, lse2, sm_scale=scale)
    valid = (indices >= 0).any(-1)
    return torch.where(valid[:, None, None], dq, 0), dkv.squeeze(1).to(kv.dtype)


# megatron-core's DSA layer scores queries in blocks of this many against all keys
_INDEXER_QUERY_BLOCK = 8192


@functools.cache
def _indexer_ops() -> Any | None:
    try:
        from megatron.core.transformer.experimental_attention_variant.ops import tilelang_dsa
    except Exception as e:
        logger.info("megatron-core's fused indexer does not import (%s)", e)
        return None
    return tilelang_dsa if tilelang_dsa.lighting_indexer_indices is not None else None


def indexer_topk_blocker(q_i, k_i, w, starts, topk: int) -> str | None:  # noqa: ANN001
    """Why megatron-core's fused indexer cannot run ``indexer_topk``'s arguments, or None."""
    if q_i.dtype != torch.bfloat16 or k_i.dtype != torch.bfloat16:
        return f"megatron-core's fused indexer is bfloat16 only, got {q_i.dtype}"
    if _indexer_ops() is None:
        return "megatron-core's TileLang indexer does not import"
    return None


def indexer_topk(q_i: torch.Tensor, k_i: torch.Tensor, w: torch.Tensor, starts: torch.Tensor, topk: int) -> torch.Tensor:
    """As :func:`loong_kernels.reference.dsa.indexer_topk`: megatron's ``run_fused_qk_topk`` as its
    DSA layer calls it (keys outside ``[starts[t], t]`` are -1), padded with -1 to ``topk`` columns."""
    seq = q_i.shape[0]
    ends = torch.arange(1, seq + 1, device=q_i.device, dtype=torch.int32)
    idx = _indexer_ops().run_fused_qk_topk(
        q_i.unsqueeze(1), k_i.unsqueeze(1), w.unsqueeze(1), topk, starts.int().contiguous(), ends, _INDEXER_QUERY_BLOCK
    )
    if idx is None:
        raise RuntimeError("megatron-core's fused indexer declined these inputs")
    return torch.nn.functional.pad(idx[0], (0, topk - idx.shape[-1]), value=-1)
