"""megatron's host-offloaded optimizer, copying the updated weights back from pinned memory.

With ``optimizer_cpu_offload`` (Loong's ``optim.offload_fraction``) megatron's
``HybridDeviceOptimizer`` keeps the offloaded share's fp32 master weights in host memory, where
torch's fused CPU AdamW updates them one tensor at a time. A step hook on each tensor's host
optimizer then copies the result into the device's bf16 weight on a side stream, meant to overlap
the next tensor's update. But the masters are ordinary pageable memory (megatron pins a bf16
clone of the weight, then keeps that clone's ``.float()``) and the copy changes the dtype, so
torch converts on the host into a new pageable tensor every step (its pages faulted in anew) and
the driver stages that through its own pinned buffer before the copy returns: the host thread
waits for every copy, and nothing overlaps.

The manifest wraps ``_register_param_copy_back_gpu_hook``: each host optimizer's hook is replaced
by :class:`PinnedCopyBack`, which converts the masters into pinned buffers of the device weights'
dtype, kept from step to step, and copies those asynchronously. The values are the same: the
conversion is the host-side cast that torch's copy did.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

TARGET = "megatron.core.optimizer.cpu_offloading.hybrid_optimizer:HybridDeviceOptimizer._register_param_copy_back_gpu_hook"


class PinnedCopyBack:
    """Post-step hook of one host optimizer of ``hdo`` (a ``HybridDeviceOptimizer``): its updated
    tensors go to their device weights through pinned buffers (``staging``), on ``hdo``'s copy
    stream; the device's current stream waits for the copies, as with megatron's own hook."""

    def __init__(self, hdo: Any) -> None:
        self.hdo = hdo
        self.staging: dict[torch.Tensor, torch.Tensor] = {}  # host master -> its pinned device-dtype copy
        self._copied: torch.cuda.Event | None = None  # the last step's copies out of ``staging``

    def _source(self, master: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if master.dtype == weight.dtype and master.is_pinned():
            return master  # nothing to convert, and already a DMA source
        buf = self.staging.get(master)
        if buf is None:
            buf = self.staging[master] = torch.empty(master.shape, dtype=weight.dtype, pin_memory=True)
        buf.copy_(master.detach())
        return buf

    @torch.no_grad()
    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        hdo = self.hdo
        if self._copied is not None:
            self._copied.synchronize()  # (long done: the last forward read these weights) buffers free
        hdo._h2d_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(hdo._h2d_stream):
            for group in optimizer.param_groups:
                for master in group["params"]:
                    weight = hdo.cpu_copys_map_gpu_param[master]
                    weight.data.copy_(self._source(master, weight), non_blocking=True)
        self._copied = hdo._h2d_stream.record_event()
        self._copied.wait(torch.cuda.current_stream())


def make_register_copy_back(accel: object = None):
    """The method the manifest puts in place of ``HybridDeviceOptimizer._register_param_copy_back_gpu_hook``:
    megatron's registration, then each host optimizer's hook swapped for :class:`PinnedCopyBack`."""
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
            optimizer.register_step_post_hook(PinnedCopyBack(self))

    return register
