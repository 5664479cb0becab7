"""ChunkPipe as a step schedule: a ``forward_backward_func`` with megatron's signature, so the
train step runs every micro-batch (one long or packed sample each) chunk by chunk
(:func:`loong_parallel.chunkpipe.chunkpipe_forward_backward`) instead of through megatron's
pipeline schedules, then finalises the gradients as megatron's schedules do (DP reduction,
division by the global loss-token count).

Usage: ``fb = chunkpipe_schedule(chunks, chunk_size, device)`` enables ChunkPipe on the model
and returns the function to pass as ``train_step(..., forward_backward_func=fb)`` (and to
``eval_step``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from megatron.core import parallel_state as mpu
from megatron.core.utils import get_model_config

from loong_models.chunked import enable_chunkpipe
from loong_parallel.chunkpipe import chunkpipe_forward, chunkpipe_forward_backward
from loong_parallel.model import unwrap
from loong_parallel.step import LOSS_KEY


def chunkpipe_schedule(chunks: list[torch.nn.Module], chunk_size: int, device: torch.device) -> Callable:
    """Enable ChunkPipe on the (single) model chunk of this pipeline stage; returns the
    step's ``forward_backward_func``. ``forward_step_func`` is not called: ChunkPipe runs the
    model itself, with the LM loss of :func:`loong_parallel.forward.masked_token_loss`."""
    if len(chunks) != 1:
        raise ValueError("ChunkPipe runs one model chunk per pipeline stage (parallel.vpp must be null)")
    if chunk_size < 1:
        raise ValueError(f"parallel.chunkpipe.chunk_size={chunk_size} must be >= 1")
    model = chunks[0]
    state = enable_chunkpipe(unwrap(model))
    config = get_model_config(model)

    def forward_backward(*, forward_step_func, data_iterator, model, num_microbatches: int, seq_length: int,
                         micro_batch_size: int, forward_only: bool = False, **_) -> list[dict]:  # fmt: skip
        del forward_step_func, seq_length  # megatron's arguments, not needed here
        if micro_batch_size != 1:
            raise ValueError(f"ChunkPipe takes one sample per micro-batch (train.micro_batch_size=1), got {micro_batch_size}")
        model = model[0] if isinstance(model, list) else model
        run = chunkpipe_forward if forward_only else chunkpipe_forward_backward
        outputs, tokens = [], torch.zeros([], dtype=torch.int, device=device)
        for _ in range(num_microbatches):
            batch = next(data_iterator)
            r = run(model, state, batch, chunk_size, device, grad_scale=config.grad_scale_func)
            tokens += r.num_tokens
            if mpu.is_pipeline_last_stage():
                loss = torch.tensor([r.loss_sum, float(r.num_tokens)], dtype=torch.float64, device=device)
                outputs.append({LOSS_KEY: loss})
        if not forward_only and config.finalize_model_grads_func is not None:
            per_token = tokens if config.calculate_per_token_loss else None
            config.finalize_model_grads_func([model], per_token)
        return outputs

    return forward_backward


__all__ = ["chunkpipe_schedule"]
