"""Send samples between data-parallel ranks with ``all_to_all``.

A sample is a dict of tensors whose first dimension may vary from sample to sample (tokens of a
document, patches of an image) while dtype and trailing dimensions are fixed per key. One
all-to-all carries the counts, one the per-sample metadata (global id and first-dimension sizes),
and one per key the concatenated data, so the exchange costs ``2 + len(keys)`` collectives
whatever the number of samples.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

Sample = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class FieldSpec:
    dtype: torch.dtype
    trailing_shape: tuple[int, ...] = ()  # shape after the variable first dimension


def field_specs(sample: Sample) -> dict[str, FieldSpec]:
    """The spec of every key of ``sample`` (all ranks must pass the same spec)."""
    return {k: FieldSpec(v.dtype, tuple(v.shape[1:])) for k, v in sample.items()}


def _all_to_all(send: torch.Tensor, send_splits: list[int], recv_splits: list[int], group, device) -> torch.Tensor:
    out = torch.empty(sum(recv_splits), *send.shape[1:], dtype=send.dtype, device=device)
    dist.all_to_all_single(out, send.to(device), recv_splits, send_splits, group=group)
    return out


def exchange_samples(
    samples: Sequence[Sample],
    global_ids: Sequence[int],
    destinations: Sequence[int],
    spec: Mapping[str, FieldSpec],
    *,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str = "cpu",
) -> list[tuple[int, dict[str, torch.Tensor]]]:
    """Send ``samples[i]`` to group rank ``destinations[i]``; return the ``(global_id, sample)``
    pairs this rank receives, sorted by global id (so the result does not depend on arrival
    order). ``device`` is where the collectives run (CUDA for NCCL); received tensors are on the CPU.
    """
    world = dist.get_world_size(group)
    keys = list(spec)
    if not (len(samples) == len(global_ids) == len(destinations)):
        raise ValueError("samples, global_ids and destinations must have the same length")
    for i, s in enumerate(samples):
        if set(s) != set(keys):
            raise ValueError(f"sample {global_ids[i]} has keys {sorted(s)}, expected {sorted(keys)}")
    order = sorted(range(len(samples)), key=lambda i: (destinations[i], global_ids[i]))
    send_counts = torch.bincount(torch.tensor([destinations[i] for i in order], dtype=torch.int64),
                                 minlength=world)
    if send_counts.numel() != world:
        raise ValueError(f"destinations must be group ranks in [0, {world})")
    recv_counts = _all_to_all(send_counts, [1] * world, [1] * world, group, device).cpu()

    # Metadata rows: global id, then the first-dimension size of every key.
    meta = torch.tensor([[global_ids[i], *(samples[i][k].shape[0] for k in keys)] for i in order],
                        dtype=torch.int64).reshape(len(order), 1 + len(keys))
    recv_meta = _all_to_all(meta, send_counts.tolist(), recv_counts.tolist(), group, device).cpu()

    received: dict[str, list[torch.Tensor]] = {}
    for col, key in enumerate(keys, start=1):
        fs = spec[key]
        parts = [samples[i][key].reshape(-1, *fs.trailing_shape).to(fs.dtype) for i in order]
        send = torch.cat(parts) if parts else torch.empty(0, *fs.trailing_shape, dtype=fs.dtype)
        send_rows = [int(meta[lo:hi, col].sum()) for lo, hi in _ranges(send_counts.tolist())]
        recv_rows = [int(recv_meta[lo:hi, col].sum()) for lo, hi in _ranges(recv_counts.tolist())]
        data = _all_to_all(send, send_rows, recv_rows, group, device).cpu()
        received[key] = list(torch.split(data, recv_meta[:, col].tolist()))
    result = [(int(recv_meta[n, 0]), {k: received[k][n] for k in keys}) for n in range(len(recv_meta))]
    return sorted(result, key=lambda item: item[0])


def _ranges(counts: list[int]) -> list[tuple[int, int]]:
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    return list(zip(bounds[:-1], bounds[1:]))
