"""megatron's host-offloaded optimizer, copying the updated weights back from pinned memory.

With ``optimizer_cpu_offload`` (Loong's ``optim.offload_fraction``) megatron's
``HybridDeviceOptimizer`` keeps the offloaded share's fp32 master weights in host memory, where
torch's fused CPU AdamW updates them one tensor at a time. A step hook on each tensor's host
optimizer then copies the result into the device's bf16 weight on a side stream, meant to overlap
the next tensor's update. But the masters are ordinary pageable memory (megatron pins a bf16
clone of the weight, then keeps that clone's ``.float()``) and the copy changes the dtype, so
torch casts on the host into a new pageable tensor every step (its pages faulted in anew) and the
driver stages that through its own pinned buffer before the copy returns: the host thread casts
and waits for every copy, and nothing overlaps.

The manifest wraps ``_register_param_copy_back_gpu_hook``: the masters move into pinned memory
once (the same tensor objects, so every map megatron keeps of them still holds), and each host
optimizer's hook is replaced by :class:`PinnedCopyBack`, which only queues work: the fp32 master
goes to the device as it is, asynchronously, and the device casts it into the weight (in chunks,
so the fp32 copy on the device stays small). The values are the same: a cast rounds to nearest
even on either side.

Ordering: the hook runs after its tensor's update, and the device's current stream waits for the
copies before its next work, as with megatron's hook. The next update of a master starts only
after ``HybridDeviceOptimizer.step`` has waited for that tensor's gradient copy, which is queued
behind all of the current stream's work, so a master is never rewritten while it is being read.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

TARGET = "megatron.core.optimizer.cpu_offloading.hybrid_optimizer:HybridDeviceOptimizer._register_param_copy_back_gpu_hook"
CHUNK = 1 << 25  # elements cast per device buffer (128 MiB of fp32)


class PinnedCopyBack:
    """Post-step hook of one host optimizer of ``hdo`` (a ``HybridDeviceOptimizer``): its updated
    (pinned) tensors go to their device weights on ``hdo``'s copy stream, cast on the device where
    the dtypes differ; the device's current stream waits for the copies."""

    def __init__(self, hdo: Any) -> None:
        self.hdo = hdo

    @torch.no_grad()
    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        hdo = self.hdo
        hdo._h2d_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(hdo._h2d_stream):
            for group in optimizer.param_groups:
                for master in group["params"]:
                    copy_to_device(master, hdo.cpu_copys_map_gpu_param[master].data)
        hdo._h2d_stream.record_event().wait(torch.cuda.current_stream())


def copy_to_device(master: torch.Tensor, weight: torch.Tensor) -> None:
    """``weight.copy_(master)`` queued on the current stream without holding the host: ``master``
    is pinned; another dtype is cast on the device through fp32 buffers of at most CHUNK elements."""
    if master.dtype == weight.dtype:
        weight.copy_(master, non_blocking=True)
        return
    if not weight.is_contiguous():
        weight.copy_(master.to(weight.device, non_blocking=True))
        return
    src, dst = master.reshape(-1), weight.view(-1)
    for start in range(0, src.numel(), CHUNK):
        part = src[start : start + CHUNK]
        dst[start : start + part.numel()].copy_(part.to(weight.device, non_blocking=True))


def make_register_copy_back(accel: object = None):
    """The method the manifest puts in place of ``HybridDeviceOptimizer._register_param_copy_back_gpu_hook``:
    megatron's registration, then the host masters pinned and each host optimizer's hook swapped
    for :class:`PinnedCopyBack`."""
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    original = HybridDeviceOptimizer._register_param_copy_back_gpu_hook

    @functools.wraps(original)
    def register(self) -> None:
        original(self)
        for optimizer in self.cpu_optimizers:
            hooks = optimizer._optimizer_step_post_hooks
            if len(hooks) != 1:
                raise RuntimeError(f"loong_xpu patch {TARGET}: expected megatron's one copy-back hook on each "
                                   f"host optimizer, found {len(hooks)} (the installed version changed it)")  # fmt: skip
            hooks.clear()
            for group in optimizer.param_groups:
                for master in group["params"]:
                    if not master.is_pinned():
                        master.data = master.data.pin_memory()  # same object: megatron's maps still hold
            optimizer.register_step_post_hook(PinnedCopyBack(self))

    return register
