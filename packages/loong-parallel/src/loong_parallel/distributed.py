"""Process-group setup for torchrun (or a single process) on any accelerator."""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch.distributed as dist

from loong_parallel.config import ParallelConfig
from loong_parallel.log import logger
from loong_xpu import Accelerator


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(accel: Accelerator, timeout_s: float = 600) -> DistEnv:
    """Join the job started by torchrun, or form a one-process job when run directly."""
    if "RANK" not in os.environ:  # plain `python` / `uv run train`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    env = DistEnv(
        int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    )
    accel.set_device(env.local_rank)
    if not dist.is_initialized():
        accel.prepare_distributed()  # registers a vendor collective backend (e.g. bkcl) by its name
        dist.init_process_group(backend=accel.dist_backend, timeout=datetime.timedelta(seconds=timeout_s))
    logger.info("rank %d/%d on %s", env.rank, env.world_size, accel.describe())
    return env


def initialize_model_parallel(pcfg: ParallelConfig, world_size: int) -> None:
    """Create megatron's TP / PP / CP / DP groups (and the expert EP / ETP / expert-DP groups) for ``pcfg``."""
    from megatron.core import parallel_state as mpu

    pcfg.data_parallel_size(world_size)
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=pcfg.tp,
        pipeline_model_parallel_size=pcfg.pp,
        virtual_pipeline_model_parallel_size=pcfg.vpp,
        context_parallel_size=pcfg.cp,
        expert_model_parallel_size=pcfg.ep,
        expert_tensor_parallel_size=pcfg.expert_tp,
    )


@dataclass(frozen=True)
class DataParallel:
    """This rank's place in megatron's data-parallel group."""

    rank: int
    size: int
    group: dist.ProcessGroup


def data_parallel() -> DataParallel:
    from megatron.core import parallel_state as mpu

    return DataParallel(mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size(),
                        mpu.get_data_parallel_group())  # fmt: skip


def shutdown(process_group: bool = True) -> None:
    """Destroy megatron's model-parallel groups, and the process group unless ``process_group``
    is False (several runs in one launch: re-creating it hangs in the env:// rendezvous)."""
    from megatron.core import parallel_state as mpu

    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    if process_group and dist.is_initialized():
        dist.destroy_process_group()
