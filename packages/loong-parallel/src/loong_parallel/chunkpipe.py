"""ChunkPipe, the schedule: one long sample through the model chunk by chunk, on one pipeline
stage or across several.

Forward runs every chunk in order; all but the last run without an autograd graph and without
the output layer (only their keys / values stay, in the model's
:class:`loong_models.chunked.ChunkState`). The last chunk keeps its graph and runs backward at
once. Then, in reverse chunk order, each earlier chunk is recomputed with its graph and run
backward; its keys / values receive, inside the attention's backward, the gradient that later
chunks accumulated for them. Activation memory is therefore one
chunk's, whatever the sample length; what grows with the length is the key/value cache.

With pipeline parallelism every stage runs the same order: forward of all chunks (activations
go to the next stage as they are made; a stage keeps the inputs it received, which are small:
``[chunk, hidden]``), then backward in reverse chunk order (each stage recomputes its part of the
chunk from the kept input, waits for the next stage's gradient, and sends its input's gradient
back). It is a per-sample forward-then-backward order (the pipeline bubble is that of a GPipe
run over the chunks), not yet the interleaved Seq1F1B order.

The loss is the sum of per-token losses over the loss mask, as megatron's per-token loss
convention has it (divided by the global token count when gradients are finalised), so chunking
is invisible to the gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

from loong_models.chunked import ChunkState
from loong_parallel.model import unwrap


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


@contextmanager
def _decoder_only(model, skip_output: bool):
    """Megatron's GPT model returns the decoder's output when it is not the post-process stage."""
    inner = unwrap(model)
    if not skip_output:
        yield
        return
    inner.post_process = False
    try:
        yield
    finally:
        inner.post_process = True


class _Stage:
    """One pipeline stage's view of one sample: chunk forwards (activations from / to the
    neighbouring stages over the pipeline group) and the chunk loss on the last stage."""

    def __init__(self, model, batch: dict, device: torch.device):
        self.model, self.device = model, device
        self.fields = {k: batch[k].to(device) for k in ("tokens", "labels", "loss_mask", "position_ids")}
        if self.fields["tokens"].shape[0] != 1:
            raise ValueError("ChunkPipe runs one sample at a time (micro-batch size 1)")
        self.first, self.last = mpu.is_pipeline_first_stage(), mpu.is_pipeline_last_stage()
        self.inputs: dict[int, torch.Tensor] = {}  # chunk -> activation received from the previous stage
        cfg = unwrap(model).config
        self.hidden, self.dtype = cfg.hidden_size, cfg.pipeline_dtype or cfg.params_dtype

    def _recv(self, rows: int, src: int) -> torch.Tensor:
        buf = torch.empty(rows, 1, self.hidden, dtype=self.dtype, device=self.device)
        dist.recv(buf, src)
        return buf

    def receive_input(self, chunk: int, a: int, b: int) -> None:
        if not self.first:
            self.inputs[chunk] = self._recv(b - a, mpu.get_pipeline_model_parallel_prev_rank())

    def forward(self, chunk: int, a: int, b: int, loss: bool = True) -> torch.Tensor:
        """The chunk's loss sum (last stage) or output activation (other stages); with
        ``loss=False`` the last stage stops after the decoder (the first pass of a chunk that
        is recomputed later only fills the key/value cache)."""
        if not self.first:
            x = self.inputs[chunk]
            if torch.is_grad_enabled():
                x.requires_grad_()
            unwrap(self.model).set_input_tensor(x)
        f = self.fields
        with _decoder_only(self.model, self.last and not loss):
            out = self.model(f["tokens"][:, a:b], f["position_ids"][:, a:b], None,
                             labels=f["labels"][:, a:b] if self.last else None)  # fmt: skip
        if not self.last or not loss:
            return out
        return (out.float() * f["loss_mask"][:, a:b].float()).sum()

    def send_output(self, out: torch.Tensor) -> None:
        if not self.last:
            dist.send(out.detach().contiguous(), mpu.get_pipeline_model_parallel_next_rank())

    def backward(self, chunk: int, out: torch.Tensor, grad_scale: Callable | None) -> None:
        """Backward of one chunk from the loss (scaled by the optimizer's ``grad_scale``, as
        megatron's schedules do; last stage) or the next stage's gradient (the gradient later
        chunks sent to this chunk's keys / values joins inside the attention's backward); then
        the input's gradient goes to the previous stage."""
        if self.last:
            (grad_scale(out) if grad_scale is not None else out).backward()
        else:
            out.backward(self._recv(out.shape[0], mpu.get_pipeline_model_parallel_next_rank()))
        if not self.first:
            dist.send(self.inputs.pop(chunk).grad.contiguous(), mpu.get_pipeline_model_parallel_prev_rank())


def chunkpipe_forward_backward(model, state: ChunkState, batch: dict, chunk_size: int, device: torch.device,
                               grad_scale: Callable | None = None) -> ChunkPipeResult:  # fmt: skip
    """Forward and backward of one sample (``[1, S]`` tokens, labels, loss_mask, position_ids;
    ``cu_seqlens`` for a packed sample) in chunks of ``chunk_size`` tokens on this pipeline
    stage (every stage of the pipeline calls it for the same sample). Gradients accumulate into
    the parameters as one backward of the whole sample would; ``loss_sum`` is the last stage's
    (0 on the others)."""
    stage = _Stage(model, batch, device)
    seq_len = stage.fields["tokens"].shape[1]
    bounds = chunk_bounds(seq_len, chunk_size)
    last = len(bounds) - 1
    state.begin_sample(stage.fields["position_ids"][0], sample_boundaries(batch, seq_len))
    rng, total = [], 0.0
    try:
        for j, (a, b) in enumerate(bounds[:last]):  # no graph: these chunks are recomputed
            rng.append(_rng_states())
            state.begin_chunk(j, a, b, build_cache=True)
            stage.receive_input(j, a, b)
            with torch.no_grad():
                out = stage.forward(j, a, b, loss=False)
            stage.send_output(out)
        state.begin_chunk(last, *bounds[last], build_cache=True)
        stage.receive_input(last, *bounds[last])
        out = stage.forward(last, *bounds[last])
        stage.send_output(out)
        total += float(out.detach()) if stage.last else 0.0
        stage.backward(last, out, grad_scale)
        for j in reversed(range(last)):
            current = _rng_states()
            _set_rng_states(rng[j])  # recompute replays the forward's dropout
            state.begin_chunk(j, *bounds[j], build_cache=False)
            out = stage.forward(j, *bounds[j])
            total += float(out.detach()) if stage.last else 0.0
            stage.backward(j, out, grad_scale)
            _set_rng_states(current)
    finally:
        state.end_sample()
    return ChunkPipeResult(total, int(stage.fields["loss_mask"].sum()))


@torch.no_grad()
def chunkpipe_forward(model, state: ChunkState, batch: dict, chunk_size: int, device: torch.device,
                      grad_scale: Callable | None = None) -> ChunkPipeResult:  # fmt: skip
    """The loss of one sample chunk by chunk, without gradients (evaluation): each chunk once,
    in order, attending to the cache of the earlier ones. ``grad_scale`` is unused (one
    signature with :func:`chunkpipe_forward_backward`)."""
    del grad_scale
    stage = _Stage(model, batch, device)
    seq_len = stage.fields["tokens"].shape[1]
    state.begin_sample(stage.fields["position_ids"][0], sample_boundaries(batch, seq_len))
    total = 0.0
    try:
        for j, (a, b) in enumerate(chunk_bounds(seq_len, chunk_size)):
            state.begin_chunk(j, a, b, build_cache=True)
            stage.receive_input(j, a, b)
            out = stage.forward(j, a, b)
            stage.send_output(out)
            total += float(out) if stage.last else 0.0
    finally:
        state.end_sample()
    return ChunkPipeResult(total, int(stage.fields["loss_mask"].sum()))
