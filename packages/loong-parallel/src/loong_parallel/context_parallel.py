"""This context-parallel rank's share of a micro-batch: the load-balanced (zigzag) slice of every
sequence, the layout megatron's RoPE and the CP attention (TE's, or loong-models' ring / a2a)
expect. Packed (THD) batches are split per document and keep the full ``cu_seqlens``."""

from __future__ import annotations

from typing import Any

import torch

from loong_models.attention.cp_layout import packed_zigzag, zigzag_positions

# Per-token fields of a micro-batch, [b, s] (THD: [1, t]).
SEQUENCE_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def context_parallel_index(batch: dict[str, Any], cp_size: int, cp_rank: int) -> torch.Tensor:
    """The positions (into the micro-batch's full sequence, int64, host) of the tokens rank
    ``cp_rank`` holds, in the order it holds them: the zigzag chunks of every sequence (of every
    THD segment). A VLM reads it to put its vision embeddings and multimodal positions, computed
    on the whole sequence, at this rank's tokens."""
    if "cu_seqlens" not in batch:
        return zigzag_positions(int(batch["tokens"].shape[1]), cp_size, cp_rank)
    cu = [int(x) for x in batch["cu_seqlens"].tolist()]
    try:
        return packed_zigzag(cu, cp_size, cp_rank)[0]
    except ValueError as e:
        raise ValueError(f"packed micro-batch with segments {cu}: {e}") from None


def split_for_context_parallel(
    batch: dict[str, Any], cp_size: int, cp_rank: int, index: torch.Tensor | None = None
) -> dict[str, Any]:
    """The micro-batch as rank ``cp_rank`` of ``cp_size`` sees it; other keys pass unchanged.
    Every sequence (every THD segment) must be divisible by ``2 * cp_size``: pad samples with
    ``loong_data.collate_packed(..., segment_multiple=2 * cp)``. ``index``: the rank's
    :func:`context_parallel_index`, when the caller has it already."""
    if cp_size == 1:
        return batch
    if index is None:
        index = context_parallel_index(batch, cp_size, cp_rank)
    out = dict(batch)
    for key in SEQUENCE_KEYS:
        if key in batch:
            out[key] = batch[key].index_select(1, index.to(batch[key].device))
    return out


def context_parallel_conflicts(pcfg, *, seq_length: int, features: dict[str, bool], balanced: bool = True) -> list[str]:
    """Why this job cannot run with ``pcfg.cp`` (empty: it can). ``features`` maps a config key
    (as the user wrote it) to whether that feature is on; every feature listed here is one that
    context parallelism does not support yet. ``balanced``: sequences are cut into 2 x cp
    load-balanced chunks (causal attention); else into cp contiguous parts (a DiT's video tokens)."""
    if pcfg.cp == 1:
        return []
    errors = [f"parallel.cp={pcfg.cp} cannot combine with {key}" for key, on in features.items() if on]
    chunks = 2 if balanced else 1
    multiple = chunks * pcfg.cp * (pcfg.tp if pcfg.sequence_parallel else 1)
    if seq_length % multiple:
        why = " x parallel.tp (sequence parallel)" if pcfg.sequence_parallel else ""
        cut = "2 x cp load-balanced chunks" if balanced else "cp equal parts"
        errors.append(
            f"data.seq_length={seq_length} must be a multiple of {'2 x ' if balanced else ''}parallel.cp{why} = "
            f"{multiple} (every sequence is cut into {cut})"
        )
    return errors


def cp_comm_type_conflicts(pcfg, foundation=None) -> dict[str, bool]:
    """Which ``parallel.cp_comm_type`` the model's attention takes under CP. DeepSeek sparse attention
    (``foundation.sparse_attention`` set; ``foundation`` None: a model without it): all-gather only (megatron-core 0.19's DSA offers no other; Loong's
    DSAttention runs the same algorithm). Dense attention: p2p or a2a (the ring and all-to-all of
    Loong's SDPAttention and of TE). Maps each refused setting to whether it is set."""
    comm = str(pcfg.cp_comm_type)
    sparse_attention = getattr(foundation, "sparse_attention", None) is not None
    return {
        f"parallel.cp_comm_type={comm} (DeepSeek sparse attention, model.foundation.sparse_attention, runs "
        "context parallelism with parallel.cp_comm_type=allgather only)": sparse_attention and comm != "allgather",
        "parallel.cp_comm_type=allgather (all-gather CP serves DeepSeek sparse attention, "
        "model.foundation.sparse_attention; dense attention takes p2p or a2a)": not sparse_attention and comm == "allgather",
    }  # fmt: skip


def encoder_context_parallel_conflicts(pcfg, encoder_tp: int | None) -> dict[str, bool]:
    """A VLM under CP: every CP rank encodes all images of its micro-batch with the shared encoder
    (at the foundation's TP size) before the sequence is cut; the parallel encoder layouts split
    images over ranks that CP would split again. Maps each refused setting to whether it is set."""
    return {
        f"parallel.encoder_layout={pcfg.encoder_layout} (use shared: every CP rank encodes its micro-batch's images)":
            str(pcfg.encoder_layout) != "shared",
        f"model.image_encoder.tensor_model_parallel_size={encoder_tp} (an encoder TP size other than "
        f"parallel.tp={pcfg.tp}; use null)": encoder_tp is not None and encoder_tp != pcfg.tp,
    }  # fmt: skip
