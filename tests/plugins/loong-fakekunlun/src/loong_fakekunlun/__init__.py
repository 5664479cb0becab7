"""loong-fakekunlun: a CPU-backed stand-in for a Kunlun XPU backend, found through the
``loong.accelerators`` entry point. ``LOONG_DEVICE=fakekunlun uv run train`` trains on it."""

from loong_fakekunlun.accelerator import FakeKunlunAccelerator
from loong_fakekunlun.collectives import BACKEND_NAME, register_collective_backend

__version__ = "0.1.0"
__all__ = ["BACKEND_NAME", "FakeKunlunAccelerator", "register_collective_backend"]
