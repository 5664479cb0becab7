"""Concatenate variable-length samples into one packed (THD) micro-batch with ``cu_seqlens``."""

from collections.abc import Mapping, Sequence

import torch

PACKED_KEYS = ("tokens", "labels", "loss_mask")


def padded_length(length: int, segment_multiple: int) -> int:
    """``length`` rounded up to a multiple of ``segment_multiple`` (what a sample occupies in a pack)."""
    return -(-length // segment_multiple) * segment_multiple


def _pad_sample(sample: Mapping[str, torch.Tensor], to: int, pad_id: int) -> dict[str, torch.Tensor]:
    extra = to - int(sample["tokens"].shape[0])
    if not extra:
        return dict(sample)
    fill = {"tokens": torch.full((extra,), pad_id, dtype=torch.long),
            "labels": torch.full((extra,), pad_id, dtype=torch.long),
            "loss_mask": torch.zeros(extra, dtype=torch.float32)}  # fmt: skip
    return {key: torch.cat([sample[key], fill[key]]) for key in PACKED_KEYS}


def collate_packed(samples: Sequence[Mapping[str, torch.Tensor]], *, capacity: int | None = None,
                   pad_id: int = 0, segment_multiple: int = 1) -> dict[str, torch.Tensor | int]:
    """One packed sequence of the samples, in order, shaped ``[1, t]`` (batch size one, as
    megatron's THD format expects).

    Returns ``tokens``, ``labels`` (int64), ``loss_mask`` (float32), ``position_ids`` (restarting
    at 0 in every sample), ``cu_seqlens`` (int32, ``[num_segments + 1]``, the segment boundaries)
    and ``max_seqlen`` (a Python int). With ``capacity``, the tail is filled with ``pad_id``
    tokens up to ``t = capacity`` as one more segment with zero loss mask: the pack has a static
    shape (pipeline stages exchange fixed-size tensors; sequence parallelism needs ``t`` divisible
    by the TP size), and the padding attends only to itself, so it changes no real token.

    ``segment_multiple``: every sample is padded at its end (``pad_id``, zero loss mask) to a
    multiple of it, and ``capacity`` must be one too. Context parallelism cuts every segment into
    ``2 * cp`` chunks, so it needs ``segment_multiple = 2 * cp``; the padding comes after the
    sample's tokens, so causal attention leaves them unchanged.
    """
    if not samples:
        raise ValueError("collate_packed needs at least one sample")
    lengths = [int(s["tokens"].shape[0]) for s in samples]
    for i, s in enumerate(samples):
        for key in PACKED_KEYS:
            if key not in s or s[key].shape != (lengths[i],):
                raise ValueError(f"sample {i}: {key!r} must be a 1-D tensor of the sample's length {lengths[i]}")
    if capacity is not None and capacity % segment_multiple:
        raise ValueError(f"pack capacity {capacity} must be a multiple of segment_multiple={segment_multiple}")
    if segment_multiple > 1:
        samples = [_pad_sample(s, padded_length(n, segment_multiple), pad_id) for s, n in zip(samples, lengths)]
        lengths = [padded_length(n, segment_multiple) for n in lengths]
    total = sum(lengths)
    out = {key: torch.cat([s[key] for s in samples]) for key in PACKED_KEYS}
    out["position_ids"] = torch.cat([torch.arange(n, dtype=torch.long) for n in lengths])
    if capacity is not None:
        if total > capacity:
            raise ValueError(f"samples hold {total} tokens, more than the pack capacity {capacity}")
        pad = capacity - total
        if pad:
            lengths.append(pad)
            out["tokens"] = torch.cat([out["tokens"], torch.full((pad,), pad_id, dtype=torch.long)])
            out["labels"] = torch.cat([out["labels"], torch.full((pad,), pad_id, dtype=torch.long)])
            out["loss_mask"] = torch.cat([out["loss_mask"], torch.zeros(pad, dtype=torch.float32)])
            out["position_ids"] = torch.cat([out["position_ids"], torch.arange(pad, dtype=torch.long)])
    batch: dict[str, torch.Tensor | int] = {key: value.unsqueeze(0) for key, value in out.items()}
    batch["cu_seqlens"] = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    batch["max_seqlen"] = max(lengths)
    return batch
