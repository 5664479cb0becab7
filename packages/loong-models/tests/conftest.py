"""An in-process world of one (gloo) with megatron's model-parallel state, on the CPU backend."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist

from loong_xpu import get_accelerator, redirect_cuda


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def megatron_cpu():
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    accel = get_accelerator("cpu")
    with redirect_cuda(accel):
        if not dist.is_initialized():
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
            dist.init_process_group("gloo", rank=0, world_size=1)
        mpu.initialize_model_parallel()
        model_parallel_cuda_manual_seed(0)
        torch.manual_seed(0)
        try:
            yield accel
        finally:
            mpu.destroy_model_parallel()
            dist.destroy_process_group()
