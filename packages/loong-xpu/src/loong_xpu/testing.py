"""pytest fixtures for code that runs megatron-core in-process on the CPU.

Use from a conftest.py: ``from loong_xpu.testing import megatron_cpu``.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from loong_xpu.accelerator import Accelerator
from loong_xpu.patches import redirect_cuda
from loong_xpu.registry import get_accelerator


def live_session_processes(sid: int) -> list[int]:
    """Processes of session ``sid`` that are still running (zombies, already dead, excluded): what a
    test that killed a process started with ``start_new_session=True`` finds left of it (Linux)."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)"
        except OSError:
            continue  # exited while we looked
        if int(fields[3]) == sid and fields[0] != "Z":
            alive.append(int(stat.parent.name))
    return alive


def launch_env(device: str = "cpu") -> dict[str, str]:
    """``os.environ`` for a process a test starts (alone or under torchrun): the device, unbuffered
    output, one thread per process, and none of the caller's rank variables."""
    env = dict(os.environ, LOONG_DEVICE=device, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def megatron_world(accel: Accelerator) -> Iterator[None]:
    """A one-process world with megatron's parallel state (TP = PP = 1) on ``accel``'s device 0 and
    collective backend (gloo on the CPU), with megatron's CUDA calls redirected where the device is
    not CUDA."""
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    with redirect_cuda(accel):
        accel.set_device(0)
        accel.prepare_distributed()  # a vendor collective backend registers itself here
        dist.init_process_group(accel.dist_backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
        mpu.initialize_model_parallel(1, 1)
        # a fresh RNG tracker per world: one left by an earlier world in this process would be of
        # that world's class (a backend's extra patches may replace it)
        model_parallel_cuda_manual_seed(0, force_reset_rng=True)
        try:
            yield
        finally:
            mpu.destroy_model_parallel()
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def megatron_cpu() -> Iterator[None]:
    """:func:`megatron_world` on the CPU, for the duration of a test module."""
    with megatron_world(get_accelerator("cpu")):
        yield


@pytest.fixture(scope="module")
def megatron_cuda() -> Iterator[None]:
    """:func:`megatron_world` on the first CUDA device, for the duration of a (GPU) test module."""
    with megatron_world(get_accelerator("cuda")):
        yield


def hybrid_device_optimizer(params: list[torch.nn.Parameter], offload_fraction: float, *, patched: bool, lr: float,
                            weight_decay: float = 0.1):  # fmt: skip
    """megatron's host-offloaded optimizer over CUDA ``params`` as megatron's optimizer factory builds
    it (torch's fused AdamW on both sides, fp32 update, copies overlapped on side streams), built
    with the patch manifest applied (``patched``: loong_xpu.offload_copy_back's copy-back and
    loong_xpu.offload_buckets' host optimizers) or not."""
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    with redirect_cuda(get_accelerator("cuda")) if patched else contextlib.nullcontext():
        return HybridDeviceOptimizer(params, offload_fraction=offload_fraction, cpu_optimizer_cls=torch.optim.AdamW,
                                     gpu_optimizer_cls=torch.optim.AdamW, overlap_cpu_optimizer_d2h_h2d=True,
                                     param_update_in_fp32=True, lr=lr, weight_decay=weight_decay, fused=True)  # fmt: skip


def train_hybrid_device_optimizer(offload_fraction: float, *, patched: bool, on_device: bool = False, steps: int = 3,
                                  state_dict: dict | None = None, moments: torch.dtype = torch.float32,
                                  remainders: bool = False) -> tuple[list[torch.Tensor], Any]:  # fmt: skip
    """Four bf16 CUDA weights (one of 1M elements) updated ``steps`` times by
    :func:`hybrid_device_optimizer`, the same bf16 gradients every run; ``on_device``: marked for
    loong_xpu.offload_device_update with its moments in ``moments`` by its ``update_on_device``
    (then call this inside ``redirect_cuda``, where its patch is in place), its masters kept as low
    halves with ``remainders``; ``state_dict``: loaded first. Returns the final weights and the optimizer."""
    from loong_xpu.offload_device_update import update_on_device

    g = torch.Generator().manual_seed(0)
    shapes = [(4096,), (1 << 20,), (3, 5), (777,)]
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to("cuda", torch.bfloat16)) for s in shapes]
    opt = hybrid_device_optimizer(params, offload_fraction, patched=patched, lr=1e-2)
    if on_device:
        update_on_device(opt, moments, remainders=remainders)
    if state_dict is not None:
        opt.load_state_dict(state_dict)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to("cuda", torch.bfloat16)
        opt.step()
    torch.cuda.synchronize()
    return [p.detach().clone() for p in params], opt
