"""ChunkPipe, the schedule: one long sample through the model chunk by chunk (PP = 1).

Forward runs every chunk in order; all but the last run without an autograd graph (only their
keys / values stay, in the model's :class:`loong_models.chunked.ChunkState`). The last chunk keeps
its graph and runs backward at once. Then, in reverse chunk order, each earlier chunk is
recomputed with its graph and run backward with extra roots: its keys / values, fed with the
gradient that later chunks accumulated in the cached copies. Activation memory is therefore one
chunk's, whatever the sample length; what grows with the length is the key/value cache.

The loss is the sum of per-token losses over the loss mask, as megatron's per-token loss
convention has it (divided by the global token count when gradients are finalised), so chunking
is invisible to the gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

from loong_models.chunked import ChunkState


@dataclass(frozen=True)
class ChunkPipeResult:
    loss_sum: float  # sum of per-token losses over the loss mask
    num_tokens: int  # tokens in the loss mask


def chunk_bounds(seq_len: int, chunk_size: int) -> list[tuple[int, int]]:
    if chunk_size < 1:
        raise ValueError(f"ChunkPipe chunk size must be >= 1, got {chunk_size}")
    return [(a, min(a + chunk_size, seq_len)) for a in range(0, seq_len, chunk_size)]


def sample_boundaries(batch: dict, seq_len: int) -> list[int]:
    """Segment starts and the end: packed samples (``cu_seqlens``) hold several documents."""
    if "cu_seqlens" not in batch:
        return [0, seq_len]
    cu = [int(x) for x in batch["cu_seqlens"].tolist()]
    if cu[0] != 0 or cu[-1] != seq_len:
        raise ValueError(f"cu_seqlens must run from 0 to the sample length {seq_len}, got {cu[0]}..{cu[-1]}")
    return cu


def _rng_states() -> tuple:
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    return torch.get_rng_state(), cuda, get_cuda_rng_tracker().get_states()


def _set_rng_states(states: tuple) -> None:
    host, cuda, tracker = states
    torch.set_rng_state(host)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)
    get_cuda_rng_tracker().set_states(tracker)


class _Sample:
    """The per-chunk forward of one sample and its loss."""

    def __init__(self, model, batch: dict, device: torch.device):
        self.model, self.device = model, device
        self.fields = {k: batch[k].to(device) for k in ("tokens", "labels", "loss_mask", "position_ids")}
        if self.fields["tokens"].shape[0] != 1:
            raise ValueError("ChunkPipe runs one sample at a time (micro-batch size 1)")

    def loss(self, a: int, b: int) -> torch.Tensor:
        f = self.fields
        per_token = self.model(f["tokens"][:, a:b], f["position_ids"][:, a:b], None, labels=f["labels"][:, a:b])
        return (per_token.float() * f["loss_mask"][:, a:b].float()).sum()


def _backward_chunk(state: ChunkState, chunk: int, loss: torch.Tensor, last: bool) -> None:
    roots, grads = [loss], [torch.ones_like(loss)]
    if not last:  # the last chunk's keys / values fed no later chunk
        for (k, v), (gk, gv) in zip(state.live_kv, state.cached_kv_grads(chunk)):
            for root, grad in ((k, gk), (v, gv)):
                if grad is not None:
                    roots.append(root)
                    grads.append(grad)
    torch.autograd.backward(roots, grads)


def chunkpipe_forward_backward(model, state: ChunkState, batch: dict, chunk_size: int,
                               device: torch.device) -> ChunkPipeResult:  # fmt: skip
    """Forward and backward of one sample (``[1, S]`` tokens, labels, loss_mask, position_ids;
    ``cu_seqlens`` for a packed sample) in chunks of ``chunk_size`` tokens. Gradients accumulate
    into the parameters as one backward of the whole sample would."""
    sample = _Sample(model, batch, device)
    seq_len = sample.fields["tokens"].shape[1]
    bounds = chunk_bounds(seq_len, chunk_size)
    state.begin_sample(sample.fields["position_ids"][0], sample_boundaries(batch, seq_len))
    rng, total = [], 0.0
    try:
        for j, (a, b) in enumerate(bounds[:-1]):
            rng.append(_rng_states())
            state.begin_chunk(j, a, b, build_cache=True)
            with torch.no_grad():
                total += float(sample.loss(a, b))
        last = len(bounds) - 1
        state.begin_chunk(last, *bounds[last], build_cache=True)
        loss = sample.loss(*bounds[last])
        total += float(loss.detach())
        _backward_chunk(state, last, loss, last=True)
        for j in reversed(range(last)):
            current = _rng_states()
            _set_rng_states(rng[j])  # recompute replays the forward's dropout
            state.begin_chunk(j, *bounds[j], build_cache=False)
            _backward_chunk(state, j, sample.loss(*bounds[j]), last=False)
            _set_rng_states(current)
    finally:
        state.end_sample()
    return ChunkPipeResult(total, int(sample.fields["loss_mask"].sum()))
