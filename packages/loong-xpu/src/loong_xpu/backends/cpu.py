"""The host CPU as a second platform: megatron-core runs on it through gloo and the redirects."""

from __future__ import annotations

import resource
import sys

import torch

from loong_xpu.accelerator import Accelerator, MemoryStats


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:  # not Linux
        return 0


def peak_rss_bytes() -> int:
    """This process's peak resident memory. On Linux it is the kernel's high-water mark of the
    process's own memory map (``VmHWM``): ``getrusage``'s ``ru_maxrss`` is not, since exec carries
    the parent's peak into it (a process started by a 1 GiB parent reports 1 GiB)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024
    except (OSError, StopIteration):  # not Linux: ru_maxrss is bytes on macOS, KiB elsewhere
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak * (1 if sys.platform == "darwin" else 1024)


class CpuAccelerator(Accelerator):
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    priority = 0

    @classmethod
    def is_available(cls) -> bool:
        return True

    def device(self, index: int | None = None) -> torch.device:
        # CPU tensors carry no index; torch.device("cpu", 0) would compare unequal to "cpu".
        return torch.device("cpu")

    def get_rng_state(self) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        torch.set_rng_state(state)

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def memory_stats(self) -> MemoryStats:
        rss = _rss_bytes()
        # the peak and statm are read at different instants: the peak is at least what is in use now
        return MemoryStats(allocated=rss, peak_allocated=max(peak_rss_bytes(), rss), reserved=rss)
