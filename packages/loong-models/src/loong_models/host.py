"""Host bookkeeping of a micro-batch (segment boundaries, patch coordinates, positions, gather
indices) moved to the device without waiting for it."""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
    """``t`` on ``device`` (None: where it is). From the host to a CUDA device the copy goes through
    page-locked memory with ``non_blocking``: a copy from pageable memory may synchronise with the
    stream (CUDA's API synchronization behavior), i.e. wait for every kernel queued before it, and
    a forward that starts with one lets the GPU run dry while the host queues the next kernels.
    torch's pinned-memory cache keeps the staging block until the copy has run."""
    if device is None:
        return t
    device = torch.device(device)
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def repeat_per_segment(values: list[int], lengths: list[int]) -> torch.Tensor:
    """``values[k]`` repeated ``lengths[k]`` times (int64 on the host), built as the cumulative
    sum of the steps between consecutive segments: a few ops whatever the segment count (torch's
    ``repeat_interleave`` with a tensor of counts took tens of ms per call on a 2-core host)."""
    steps = torch.zeros(sum(lengths), dtype=torch.long)
    at, previous, where, step = 0, 0, [], []
    for value, n in zip(values, lengths):
        if n:
            where.append(at)
            step.append(value - previous)
            previous, at = value, at + n
    steps[torch.tensor(where, dtype=torch.long)] = torch.tensor(step, dtype=torch.long)
    return steps.cumsum(0)
