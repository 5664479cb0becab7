"""FakeKunlunAccelerator: every seam a Kunlun XPU backend fills, on the host CPU.

Tensors live on the CPU (a real backend returns its own device type, e.g. ``xpu``); the name,
the collective backend, the feature set, the RNG / stream / event / memory hooks and the extra
patches are the backend's own. Each hook counts its calls in ``self.calls`` so tests can see it
was used; with ``LOONG_FAKEKUNLUN_REPORT=<dir>`` the counts are written there at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
from collections import Counter
from pathlib import Path

import torch

from loong_fakekunlun.collectives import BACKEND_NAME, register_collective_backend
from loong_fakekunlun.patches import extra_patches
from loong_xpu import Accelerator, MemoryStats
from loong_xpu.accelerator import HostEvent, HostStream
from loong_xpu.backends.cpu import CpuAccelerator

REPORT_ENV = "LOONG_FAKEKUNLUN_REPORT"


def _counting_queue_types(calls: Counter) -> tuple[type, type]:
    """Stream and Event classes bound to ``calls`` (what megatron creates as torch.cuda.Stream/Event)."""

    class FakeKunlunStream(HostStream):
        def __init__(self, *args, **kwargs) -> None:
            calls["stream.create"] += 1

        def wait_stream(self, stream: object) -> None:
            calls["stream.wait_stream"] += 1

    class FakeKunlunEvent(HostEvent):
        def record(self, stream: object = None) -> None:
            calls["event.record"] += 1
            super().record(stream)

    return FakeKunlunStream, FakeKunlunEvent


class FakeKunlunAccelerator(Accelerator):
    name = "fakekunlun"
    device_type = "cpu"  # a real Kunlun backend: its own torch device type
    dist_backend = BACKEND_NAME
    # Below the CPU's 0: installed in every test environment, it must never win LOONG_DEVICE=auto
    # there. A real backend picks e.g. 50 (after CUDA, before the CPU) and checks for its device.
    priority = -10
    # No TE, FP8, CUDA graphs, grouped GEMM, DeepEP or concurrent queues: configs that ask for
    # them are refused naming this backend (as LoongForge's XPU scripts disable TE).
    features = frozenset()

    def __init__(self) -> None:
        self.calls: Counter = Counter()
        self.Stream, self.Event = _counting_queue_types(self.calls)
        self._host = CpuAccelerator()  # the "device runtime" this stand-in forwards to
        if os.environ.get(REPORT_ENV):
            atexit.register(self._write_report)

    @classmethod
    def is_available(cls) -> bool:
        return True  # a real backend: torch.xpu.is_available() / the vendor runtime finds a device

    def device(self, index: int | None = None) -> torch.device:
        return torch.device("cpu")

    def set_device(self, index: int) -> None:
        self.calls["set_device"] += 1

    def synchronize(self) -> None:
        self.calls["synchronize"] += 1

    def current_stream(self) -> object:
        self.calls["current_stream"] += 1
        return self.Stream()

    def stream(self, stream: object) -> contextlib.AbstractContextManager:
        self.calls["stream.enter"] += 1
        return contextlib.nullcontext()

    def empty_cache(self) -> None:
        self.calls["empty_cache"] += 1

    # The TP RNG streams and the default generator: the host generator, so losses equal the CPU's.
    def get_rng_state(self) -> torch.Tensor:
        self.calls["get_rng_state"] += 1
        return self._host.get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self.calls["set_rng_state"] += 1
        self._host.set_rng_state(state)

    def manual_seed(self, seed: int) -> None:
        self.calls["manual_seed"] += 1
        self._host.manual_seed(seed)

    def memory_stats(self) -> MemoryStats:
        self.calls["memory_stats"] += 1
        return self._host.memory_stats()

    def prepare_distributed(self) -> None:
        self.calls["prepare_distributed"] += 1
        register_collective_backend()

    def extra_patches(self) -> tuple:
        return extra_patches(self.calls)

    def _write_report(self) -> None:
        if not self.calls:
            return  # an instance that only answered a query (e.g. the kernel dispatcher's)
        out = Path(os.environ[REPORT_ENV])
        out.mkdir(parents=True, exist_ok=True)
        rank = os.environ.get("RANK", "0")
        (out / f"rank{rank}-{id(self)}.json").write_text(json.dumps(dict(self.calls)))
