"""megatron's host-offloaded optimizer, with one host AdamW per bucket of tensors instead of per tensor.

``HybridDeviceOptimizer`` (Loong's ``optim.offload_fraction``) builds one host optimizer per
offloaded tensor so that a tensor's update can start as soon as its gradient is on the host, and
its copy back to the device can start as soon as it is updated. An MoE rank has hundreds of them
(528 at qwen3-30b-a3b x 4 layers, EP=2: one per expert and projection), and each ``AdamW.step``
costs its Python, dispatch and hook overhead on top of the fused kernel: on an H200 host the 528
steps took 727 ms of which the kernels were 471 ms (profile of one EP=2 step).

The manifest wraps ``build_cpu_optimizer_list``: consecutive tensors of a parameter group share one
host optimizer until they hold :data:`BUCKET` elements (a larger tensor is a bucket of its own).
The update is the same AdamW over the same tensors (the fused kernel updates each tensor of its
list independently), so the weights are the same; the copies still overlap the updates, a bucket
(at most 128 MiB of fp32) at a time instead of a tensor at a time.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

TARGET = "megatron.core.optimizer.cpu_offloading.hybrid_optimizer:HybridDeviceOptimizer.build_cpu_optimizer_list"
BUCKET = 1 << 25  # elements per host optimizer (128 MiB of fp32)


class HasNumel(Protocol):
    """A tensor, or anything else that says how many elements it holds."""

    def numel(self) -> int: ...


def buckets[T: HasNumel](params: list[T], limit: int) -> list[list[T]]:
    """``params`` (tensors, or anything with ``numel()``) in order, cut into runs of at most
    ``limit`` elements (a larger one alone)."""
    runs: list[list[T]] = []
    size = 0
    for p in params:
        if not runs or size + p.numel() > limit:
            runs.append([])
            size = 0
        runs[-1].append(p)
        size += p.numel()
    return runs


def make_build_cpu_optimizer_list(accel: object = None) -> staticmethod:
    """The static method the manifest puts in place of ``HybridDeviceOptimizer.build_cpu_optimizer_list``:
    one ``cpu_optimizer_cls`` per bucket of each parameter group, with that group's settings."""

    def build_cpu_optimizer_list(cpu_optimizer_cls: type, cpu_param_groups: list[dict[str, Any]]) -> list:
        optimizers = []
        for group in cpu_param_groups:
            settings = {k: v for k, v in group.items() if k != "params"}
            params = group["params"]
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            for run in buckets(params, BUCKET):
                optimizers.append(cpu_optimizer_cls([{**settings, "params": run}]))
        return optimizers

    return staticmethod(build_cpu_optimizer_list)
