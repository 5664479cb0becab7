"""The random state of a run: seeding, and capture / restore for checkpoints."""

from __future__ import annotations

import torch

from loong_xpu import Accelerator


def seed_everything(seed: int) -> None:
    """megatron's model-parallel RNG tracker, and an identical host RNG on every rank (CPU init is
    then layout independent)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)


def rng_state(accel: Accelerator) -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return {"cpu": torch.get_rng_state(), "device": accel.get_rng_state(),
            "tracker": get_cuda_rng_tracker().get_states()}  # fmt: skip


def set_rng_state(accel: Accelerator, state: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(state["cpu"])
    accel.set_rng_state(state["device"])
    get_cuda_rng_tracker().set_states(state["tracker"])
