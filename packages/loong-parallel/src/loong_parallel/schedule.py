"""What megatron's pipeline schedules need to know about a step's micro-batches."""

from __future__ import annotations

from collections.abc import Iterator


def schedule_shape(microbatches: list[dict], key: str = "tokens") -> dict[str, int]:
    """megatron schedule arguments of a step: its micro-batch count and the ``[micro_batch_size,
    seq_length]`` shape the pipeline stages exchange, read from ``key`` of the first micro-batch
    (fixed rows: ``[micro_batch_size, seq_length]``; packed sequences: ``[1, capacity]``)."""
    first = microbatches[0]
    if key not in first:  # no token rows (a diffusion model's latents): only PP=1, the shape is unused
        rows = next(iter(first.values())).shape[0]
        return dict(num_microbatches=len(microbatches), seq_length=1, micro_batch_size=int(rows))
    rows, length = first[key].shape[:2]
    return dict(num_microbatches=len(microbatches), seq_length=int(length), micro_batch_size=int(rows))


def microbatch_iterators(microbatches: list[dict], num_chunks: int) -> Iterator | list[Iterator]:
    """One iterator per virtual pipeline chunk (megatron's interleaved schedule), else one."""
    its = [iter(microbatches) for _ in range(num_chunks)]
    return its if num_chunks > 1 else its[0]
