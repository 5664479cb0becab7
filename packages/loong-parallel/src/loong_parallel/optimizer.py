"""megatron-core optimizer (optionally distributed) and the LR schedule."""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import StrEnum

import torch
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from loong_parallel.config import ParallelConfig
from loong_parallel.log import logger
from loong_xpu.offload_device_update import update_on_device


class LRSchedule(StrEnum):
    """The learning rate after warmup (megatron's lr_decay_style)."""

    cosine = "cosine"
    linear = "linear"
    constant = "constant"


class OffloadUpdate(StrEnum):
    """Where the offloaded share of the optimizer is updated (optim.offload_update)."""

    host = "host"  # megatron's: torch's fused CPU AdamW on the host state
    device = "device"  # the host state streamed through the GPU and updated there (loong_xpu.offload_device_update)


class OffloadMaster(StrEnum):
    """How the offloaded share's fp32 master weights are kept (optim.offload_master)."""

    fp32 = "fp32"  # megatron's: whole in host memory, 4 bytes a parameter each way a step
    remainder = "remainder"  # their low 16 bits in host memory beside the bf16 weights: 2 bytes each way


class StateDtype(StrEnum):
    """The dtype of Adam's two moments (optim.state_dtype)."""

    fp32 = "fp32"
    bf16 = "bf16"


@dataclass
class OptimConfig:
    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup_steps: int = 10
    schedule: LRSchedule = LRSchedule.cosine
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip_grad: float = 1.0
    # megatron's precision-aware optimizer (CUDA, Transformer Engine's FusedAdam, the distributed
    # optimizer): the fp32 master weights live inside FusedAdam (kept exactly, as the bf16 weight
    # plus its 16 low bits) and its kernel writes the bf16 weights itself, so no separate
    # master-to-model copy runs after the update
    precision_aware: bool = False
    # Adam's moments: bf16 halves their memory and the update's traffic (needs precision_aware);
    # the master weights and gradients stay fp32. With offload_fraction (offload_update=device) it
    # is the offloaded share's moments in host memory: a third fewer bytes to stream each step; the
    # share left on the GPU keeps fp32 moments (megatron's hybrid optimizer takes no moments dtype)
    state_dtype: StateDtype = StateDtype.fp32
    # The share of the optimizer's parameters (in elements, in parameter order) whose fp32 master
    # weights and Adam moments live in pinned host memory (megatron's HybridDeviceOptimizer; needs
    # precision_aware): the GPU keeps the bf16 weights and the gradient buffer. The update costs
    # time once per step, so it pays with many micro-batches per step (bench/moe_throughput.py).
    offload_fraction: float = 0.0
    # Host threads of the host update (offload_update=host). null: OMP_NUM_THREADS where it is
    # set to more than 1, else this process's share of the CPUs it may run on (torchrun sets
    # OMP_NUM_THREADS=1 in every process, which leaves a memory-bound update on one core).
    host_threads: int | None = None
    # Where that share is updated. device: the host state is streamed through the GPU in chunks
    # each step and updated there by the CUDA build of torch's fused AdamW (copies on side streams;
    # the host moves 24 bytes a parameter by DMA and computes nothing; loong_xpu.offload_device_update).
    # host: megatron's, torch's fused CPU AdamW reading and writing the host state (28 bytes a
    # parameter, bound by the host's memory bandwidth), gradients to the host and weights back on
    # side streams. The same peak GPU memory, the same losses up to rounding.
    offload_update: OffloadUpdate = OffloadUpdate.device
    # How the device update keeps that share's fp32 master weights. remainder: as their low 16 bits
    # beside the bf16 weights, the layout TE's FusedAdam keeps the GPU share's masters in (the weight
    # rounded to nearest, ties away from zero; the pair is the master bit for bit), so 2 bytes a
    # parameter travel each way instead of 4: 20 bytes a step by DMA instead of 24 (12 instead of 16
    # with bf16 moments). megatron's fp32 host masters are written back before a checkpoint reads
    # them (loong_xpu.offload_device_update). Needs offload_update=device and bf16 weights.
    offload_master: OffloadMaster = OffloadMaster.fp32

    def updates_offloaded_share_on(self, where: OffloadUpdate) -> bool:
        """Whether a share is offloaded (``offload_fraction > 0``) and updated ``where``."""
        return self.offload_fraction > 0 and self.offload_update == where

    def validate(self) -> None:
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"optim.min_lr={self.min_lr} must be in [0, optim.lr={self.lr}]")
        if self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps={self.warmup_steps} must be >= 0")
        if self.state_dtype != StateDtype.fp32 and not self.precision_aware:
            raise ValueError(f"optim.state_dtype={self.state_dtype} needs optim.precision_aware=true "
                             "(megatron keeps Adam's moments in fp32 otherwise)")  # fmt: skip
        if not 0.0 <= self.offload_fraction <= 1.0:
            raise ValueError(f"optim.offload_fraction={self.offload_fraction} must be in [0, 1]")
        if self.offload_fraction > 0 and not self.precision_aware:
            raise ValueError(f"optim.offload_fraction={self.offload_fraction} needs optim.precision_aware=true "
                             "(megatron's host offload runs on the precision-aware optimizer's path)")  # fmt: skip
        if self.host_threads is not None and self.host_threads < 1:
            raise ValueError(f"optim.host_threads={self.host_threads} must be >= 1 or null (automatic)")
        if self.offload_master == OffloadMaster.remainder and not self.updates_offloaded_share_on(OffloadUpdate.device):
            raise ValueError(f"optim.offload_master={self.offload_master} needs optim.offload_fraction > 0 (it is "
                             f"{self.offload_fraction}) and optim.offload_update=device (it is {self.offload_update})")  # fmt: skip
        if self.state_dtype != StateDtype.fp32 and self.updates_offloaded_share_on(OffloadUpdate.host):
            raise ValueError(f"optim.offload_fraction={self.offload_fraction} with optim.state_dtype={self.state_dtype} "
                             "needs optim.offload_update=device (the host update is torch's fused CPU AdamW, fp32 moments)")  # fmt: skip

    def precision_aware_errors(self, distributed_optimizer: bool, device_type: str) -> list[str]:
        """Why ``precision_aware`` cannot run with this layout / device (empty: it can, or it is off)."""
        if not self.precision_aware:
            return []
        errors = []
        if not distributed_optimizer:
            errors.append("optim.precision_aware=true needs parallel.distributed_optimizer=true (megatron's rule)")
        if device_type != "cuda":
            errors.append(f"optim.precision_aware=true needs CUDA (Transformer Engine's FusedAdam); "
                          f"the device is {device_type}")  # fmt: skip
        return errors


def host_threads_for(ocfg: OptimConfig, *, affinity: int, parent_affinity: int, local_world_size: int,
                     omp_num_threads: str | None) -> int | None:
    """Threads for the host-side update of ``optim.offload_fraction`` (None: nothing updated on the
    host: nothing offloaded, or the offloaded share updated on the device).
    ``affinity``: CPUs this process may run on; ``parent_affinity``: its launcher's. A process bound
    to fewer CPUs than its launcher (torchrun --numa-binding, taskset) uses all of its own; an
    unbound one its share among the ``local_world_size`` processes of this machine. (The
    launcher, not the machine: a container's CPU set limits both.)"""
    if not ocfg.updates_offloaded_share_on(OffloadUpdate.host):
        return None
    if ocfg.host_threads is not None:
        return ocfg.host_threads
    if omp_num_threads and omp_num_threads.strip().isdigit() and int(omp_num_threads) > 1:
        return int(omp_num_threads)
    if affinity < parent_affinity:
        return max(1, affinity)
    return max(1, affinity // max(1, local_world_size))


def _set_host_threads(ocfg: OptimConfig) -> None:
    affinity = len(os.sched_getaffinity(0))
    try:
        parent_affinity = len(os.sched_getaffinity(os.getppid()))
    except OSError:  # the launcher is gone or not ours to inspect: read this process as unbound
        parent_affinity = affinity
    threads = host_threads_for(ocfg, affinity=affinity, parent_affinity=parent_affinity,
                               local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                               omp_num_threads=os.environ.get("OMP_NUM_THREADS"))  # fmt: skip
    if threads is None:
        return
    torch.set_num_threads(threads)
    logger.info("optimizer offload: the host update runs on %d threads (optim.host_threads=%s)",
                threads, ocfg.host_threads)  # fmt: skip


def schedule_steps(lr: float, warmup_steps: int, total_steps: int) -> dict:
    """megatron's scheduler arguments such that step ``s`` (1-based) runs at the rate of the
    schedule at ``s``: warm-up ``lr * s / W`` for ``s <= W`` (never 0), then the decay reaching
    ``min_lr`` at ``total_steps``. megatron sets the rate for step ``s`` from ``s - 1`` completed
    steps (its step 1 of a warm-up runs at ``init_lr`` = 0); shifting its warm-up and decay by one
    step gives exactly the schedule at ``s`` while its counter keeps counting completed steps, so
    checkpoints resume as they are."""
    warmup = min(warmup_steps, max(total_steps - 1, 0))
    if warmup == 0:  # no warm-up: full rate at step 1, decay over the remaining steps
        return dict(init_lr=lr, max_lr=lr, lr_warmup_steps=0, lr_decay_steps=max(total_steps - 1, 1))
    return dict(init_lr=lr / warmup, max_lr=lr, lr_warmup_steps=warmup - 1,
                lr_decay_steps=max(total_steps, warmup + 1) - 1)  # fmt: skip


_MOMENTS = {StateDtype.fp32: torch.float32, StateDtype.bf16: torch.bfloat16}


def _precision_aware_fields(ocfg: OptimConfig) -> dict:
    if not ocfg.precision_aware:
        return {}
    # with the state offloaded megatron's own moments stay fp32 (its device share, its checkpoint
    # buffers); the offloaded share's are kept in state_dtype by the device update (build_optimizer)
    moments = torch.float32 if ocfg.offload_fraction > 0 else _MOMENTS[ocfg.state_dtype]
    fields = dict(use_precision_aware_optimizer=True, main_params_dtype=torch.float32,
                  main_grads_dtype=torch.float32, exp_avg_dtype=moments, exp_avg_sq_dtype=moments)  # fmt: skip
    if ocfg.offload_fraction > 0:
        # the copies overlap the host update (megatron's recommendation; off, each waits for the other)
        fields.update(optimizer_cpu_offload=True, optimizer_offload_fraction=ocfg.offload_fraction,
                      overlap_cpu_optimizer_d2h_h2d=True)  # fmt: skip
    return fields


def optimizer_config_for(ocfg: OptimConfig, pcfg: ParallelConfig, dtype: torch.dtype) -> OptimizerConfig:
    """megatron's OptimizerConfig for this optimizer and layout (AdamW, decoupled weight decay)."""
    return OptimizerConfig(
        optimizer="adam",
        lr=ocfg.lr,
        min_lr=ocfg.min_lr,
        weight_decay=ocfg.weight_decay,
        adam_beta1=ocfg.beta1,
        adam_beta2=ocfg.beta2,
        adam_eps=ocfg.eps,
        clip_grad=ocfg.clip_grad,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        use_distributed_optimizer=pcfg.distributed_optimizer,
        overlap_param_gather=pcfg.overlap_param_gather,
        **_precision_aware_fields(ocfg),
    )


def build_optimizer(
    ocfg: OptimConfig,
    pcfg: ParallelConfig,
    chunks: list[torch.nn.Module],
    *,
    dtype: torch.dtype,
    total_steps: int,
) -> tuple[MegatronOptimizer, OptimizerParamScheduler]:
    """AdamW with fp32 master weights for bf16/fp16 training (with ``ocfg.precision_aware`` held
    by TE's FusedAdam, the moments in ``ocfg.state_dtype``); warmup then ``ocfg.schedule`` decay
    to ``min_lr`` at ``total_steps`` (:func:`schedule_steps`)."""
    ocfg.validate()
    if ocfg.offload_master == OffloadMaster.remainder and dtype != torch.bfloat16:
        raise ValueError(f"optim.offload_master={ocfg.offload_master} needs bf16 weights (train.dtype=bf16); "
                         f"the weights are {dtype}")  # fmt: skip
    device_type = next(p.device.type for c in chunks for p in c.parameters())
    for error in ocfg.precision_aware_errors(pcfg.distributed_optimizer, device_type):
        raise ValueError(error)
    _set_host_threads(ocfg)
    optimizer = get_megatron_optimizer(optimizer_config_for(ocfg, pcfg, dtype), chunks)
    if ocfg.updates_offloaded_share_on(OffloadUpdate.device):
        remainders = ocfg.offload_master == OffloadMaster.remainder
        marked = update_on_device(optimizer, _MOMENTS[ocfg.state_dtype], remainders=remainders)
        logger.info("optimizer offload: %d host-offloaded optimizer(s) updated on the device, moments in %s, "
                    "masters %s (optim.offload_update=device)", marked, ocfg.state_dtype,
                    "as low halves beside the bf16 weights" if remainders else "in fp32")  # fmt: skip
    scheduler = OptimizerParamScheduler(
        optimizer,
        **schedule_steps(ocfg.lr, ocfg.warmup_steps, total_steps),
        min_lr=ocfg.min_lr,
        lr_decay_style=str(ocfg.schedule),  # a plain str: it is saved in checkpoints
        start_wd=ocfg.weight_decay,
        end_wd=ocfg.weight_decay,
        wd_incr_steps=max(total_steps, 1),
        wd_incr_style="constant",
    )
    return optimizer, scheduler

