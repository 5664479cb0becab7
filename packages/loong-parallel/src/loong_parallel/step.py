"""One optimizer step (or one evaluation pass) through megatron-core's pipeline schedules."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.optimizer import ChainedOptimizer, MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_model_config

from loong_parallel.grad_accumulation import batched, flush_grads, flushing_forward_step
from loong_parallel.model import unwrap
from loong_xpu.nonfinite_step import step_unless_nonfinite

# The loss function handed to megatron returns (loss_sum, num_tokens, {LOSS_KEY: [sum, count]}).
LOSS_KEY = "lm loss"


@dataclass(frozen=True)
class StepResult:
    loss: float  # token-weighted mean over the global batch
    num_tokens: int  # loss tokens in the global batch
    grad_norm: float | None
    lr: float
    skipped: bool  # no update this step: non-finite loss / gradients, or an fp16 loss-scale overflow
    # Seconds from the start of the step until gradient finalisation began on this rank: its own
    # forward/backward work, without waiting for other data-parallel ranks (None: not measured).
    compute_s: float | None = None
    nonfinite: bool = False  # skipped because the loss or a gradient was NaN / Inf


@contextmanager
def _before_finalize(chunks: list[torch.nn.Module], *actions: Callable[[], None]):
    """Run ``actions``, in order, when megatron calls ``finalize_model_grads`` (after the last
    backward, before the data-parallel reduction waits for the slowest rank)."""
    if not actions:
        yield
        return
    config = get_model_config(chunks[0])
    original = config.finalize_model_grads_func

    def finalize(*args, **kwargs):
        for action in actions:
            action()
        return original(*args, **kwargs)

    config.finalize_model_grads_func = finalize
    try:
        yield
    finally:
        config.finalize_model_grads_func = original


def _time_compute(synchronize: Callable[[], None], out: dict) -> Callable[[], None]:
    """An action for :func:`_before_finalize` noting ``out["compute_s"]``: the seconds from now
    until gradient finalisation begins, this rank's own work measured after a device sync."""
    t0 = time.perf_counter()

    def note() -> None:
        synchronize()
        out["compute_s"] = time.perf_counter() - t0

    return note


def _loss_totals(per_microbatch: list[dict], device: torch.device) -> torch.Tensor:
    """[loss_sum, count] summed over micro-batches and over all ranks that computed a loss (last
    pipeline stage, TP rank 0 of each DP replica), on the device: the same on every rank."""
    total = torch.zeros(2, dtype=torch.float64, device=device)
    counts_here = mpu.is_pipeline_last_stage(ignore_virtual=True) and mpu.get_tensor_model_parallel_rank() == 0
    if counts_here:
        for out in per_microbatch:
            total += out[LOSS_KEY].to(total)
    dist.all_reduce(total)
    return total


def _mean_loss(totals: list[float]) -> tuple[float, int]:
    loss_sum, count = totals
    return loss_sum / max(count, 1.0), int(count)


def _global_loss(per_microbatch: list[dict], device: torch.device) -> tuple[float, int]:
    """The global token-weighted mean loss and its token count (read on the host)."""
    return _mean_loss(_loss_totals(per_microbatch, device).tolist())


def schedule_for(chunks: list[torch.nn.Module], schedule: Callable | None = None) -> Callable:
    """The step's schedule (``schedule``, e.g. ChunkPipe's, else megatron's for the layout), wrapped
    by the model when it runs work around it (the ``decoupled`` image-encoder layout encodes before
    it: loong_parallel.encoder_layout)."""
    func = schedule or get_forward_backward_func()
    wrapper = getattr(unwrap(chunks[0]), "forward_backward_wrapper", None)
    return wrapper(func) if wrapper is not None else func


def _schedule_kwargs(num_microbatches: int, seq_length: int, micro_batch_size: int) -> dict:
    return dict(num_microbatches=num_microbatches, seq_length=seq_length, micro_batch_size=micro_batch_size)


def train_step(
    forward_step: Callable,
    data_iterator: Iterator | list[Iterator],
    chunks: list[torch.nn.Module],
    optimizer: MegatronOptimizer,
    scheduler: OptimizerParamScheduler,
    *,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    device: torch.device,
    synchronize: Callable[[], None] | None = None,
    forward_backward_func: Callable | None = None,
) -> StepResult:
    """One optimizer step. With ``synchronize`` (the accelerator's), also measures
    :attr:`StepResult.compute_s`, the input of DP load balancing's online cost fit.
    ``forward_backward_func``: the schedule (default: megatron's for the layout; ChunkPipe's
    from :func:`loong_parallel.chunkpipe_schedule.chunkpipe_schedule`)."""
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    timing: dict[str, float] = {}
    if batched(chunks):  # parallel.grad_accumulation=batched: gradients added per micro-batch, not per parameter
        forward_step = flushing_forward_step(forward_step, chunks)
    before_finalize = []  # the last micro-batch's gradients reach main_grad before megatron reduces it
    if batched(chunks):
        before_finalize.append(partial(flush_grads, chunks))
    if synchronize:
        before_finalize.append(_time_compute(synchronize, timing))
    with _before_finalize(chunks, *before_finalize):
        outputs = schedule_for(chunks, forward_backward_func)(
            forward_step_func=forward_step,
            data_iterator=data_iterator,
            model=chunks,
            forward_only=False,
            **_schedule_kwargs(num_microbatches, seq_length, micro_batch_size),
        )
    lr = optimizer.param_groups[0]["lr"]  # the rate of this step (the scheduler then sets the next one)
    totals = _loss_totals(outputs, device)
    # never let NaN / Inf into the weights or the optimizer's moments
    if _norm_guards_update(optimizer, chunks):
        # the update runs only if megatron's norm and the loss are finite (loong_xpu's patch). Both
        # are read on the host in one read, as the norm is computed and before the update is
        # queued: no host sync between the backward and the optimizer's own work (which would
        # leave the device idle while the host prepares it), and no wait for the update itself.
        ok, grad_norm, read = step_unless_nonfinite(optimizer, watch=totals)
        loss, count = _mean_loss(read)
        nonfinite = not math.isfinite(loss) or (grad_norm is not None and not math.isfinite(grad_norm))
    else:
        loss, count = _mean_loss(totals.tolist())
        nonfinite = not math.isfinite(loss) or not _grads_finite(chunks, device)
        ok, grad_norm = False, None
        if not nonfinite:
            ok, grad_norm, _ = optimizer.step()
            grad_norm = float(grad_norm) if grad_norm is not None else None
            nonfinite = grad_norm is not None and not math.isfinite(grad_norm)
    if ok:
        scheduler.step(increment=1)
    return StepResult(loss, count, grad_norm, lr, not ok, timing.get("compute_s"), nonfinite)


def _norm_guards_update(optimizer: MegatronOptimizer, chunks: list[torch.nn.Module]) -> bool:
    """Whether the optimizer's own gradient norm can serve as the finiteness check: megatron's
    ChainedOptimizer (what get_megatron_optimizer builds) computes the global norm of every gradient
    it steps before clipping, and a NaN / Inf gradient makes it non-finite. Then no second pass
    over the gradients (and no second host sync) runs before the step. Not with fp16 loss scaling,
    where megatron finds overflows itself. The skip itself is loong_xpu's patch of megatron's
    ChainedOptimizer (loong_xpu.nonfinite_step)."""
    return isinstance(optimizer, ChainedOptimizer) and not get_model_config(chunks[0]).fp16


def _grads_finite(chunks: list[torch.nn.Module], device: torch.device) -> bool:
    """Whether every gradient of every rank is finite (collective). With fp16 loss scaling an
    overflow is routine: megatron's optimizer finds it, lowers the scale and skips the step."""
    if get_model_config(chunks[0]).fp16:
        return True
    grads = [p.main_grad if hasattr(p, "main_grad") else p.grad for c in chunks for p in c.parameters()]
    grads = [g for g in grads if g is not None]
    bad = torch.zeros(1, device=device)
    if grads:  # a NaN anywhere in a rank's (partial) gradients reaches the reduced ones
        bad = (~torch.isfinite(torch.stack(torch._foreach_norm(grads)))).any().float().reshape(1)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return not bad.item()


@torch.no_grad()
def eval_step(
    forward_step: Callable,
    data_iterator: Iterator | list[Iterator],
    chunks: list[torch.nn.Module],
    *,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    device: torch.device,
    forward_backward_func: Callable | None = None,
) -> tuple[float, int]:
    """Mean loss over ``num_microbatches`` micro-batches per DP rank, without updating."""
    for chunk in chunks:
        chunk.eval()
    try:
        with _eager_layers(chunks):
            outputs = schedule_for(chunks, forward_backward_func)(
                forward_step_func=forward_step,
                data_iterator=data_iterator,
                model=chunks,
                forward_only=True,
                **_schedule_kwargs(num_microbatches, seq_length, micro_batch_size),
            )
    finally:
        for chunk in chunks:
            chunk.train()
    return _global_loss(outputs, device)


@contextmanager
def _eager_layers(chunks: list[torch.nn.Module]):
    """Megatron's per-layer CUDA graphs (parallel.cuda_graphs=local) hold a training step's forward
    and backward; a forward-only pass runs the layers eagerly in between (megatron's own switch,
    ``toggle_cuda_graphs``, which keeps the captured graphs for the next training step)."""
    models = [m for m in map(unwrap, chunks) if _graph_impl(m) == "local"]
    if not models:
        yield
        return
    from megatron.core.transformer.utils import toggle_cuda_graphs

    for m in models:
        toggle_cuda_graphs(m, set_to="none")
    try:
        yield
    finally:
        for m in models:
            toggle_cuda_graphs(m, set_to="local")


def _graph_impl(model: torch.nn.Module) -> str:
    return getattr(getattr(model, "config", None), "cuda_graph_impl", "none")
