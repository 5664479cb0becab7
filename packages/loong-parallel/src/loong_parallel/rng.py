"""The random state of a run: seeding, and capture / restore for checkpoints."""

from __future__ import annotations

import torch

from loong_xpu import Accelerator


def seed_everything(seed: int, *, graph_safe: bool = False) -> None:
    """megatron's model-parallel RNG tracker, and an identical host RNG on every rank (CPU init is
    then layout independent). ``graph_safe``: TE's tracker, whose generators CUDA graphs can
    capture (megatron's per-layer graphs refuse any other; parallel.cuda_graphs)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    # the tracker is created once per process: a graph-safe one replaces whatever was there
    model_parallel_cuda_manual_seed(seed, te_rng_tracker=graph_safe, force_reset_rng=graph_safe)
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
