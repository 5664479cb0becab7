"""The Accelerator interface: everything Loong needs to know about a device family."""

from __future__ import annotations

import abc
import contextlib
import os
import time
from dataclasses import dataclass

import torch

#: Optional features a backend may have; a config that asks for one the backend lacks is refused
#: naming the backend, the feature and the config key (:meth:`Accelerator.require`).
FEATURES = (
    "te",  # Transformer Engine layers (model.layer_backend=te)
    "fp8",  # FP8 GEMMs
    "cuda_graphs",  # captured step graphs
    "grouped_gemm",  # one GEMM for all local experts
    "deepep",  # DeepEP's fused MoE all-to-all
    "side_streams",  # queues that run concurrently (communication / offload overlap)
)


class UnsupportedFeatureError(ValueError):
    """A config asks for a feature the accelerator lacks; the message names backend and key."""


@dataclass(frozen=True)
class MemoryStats:
    """Bytes in use now and at peak on the current device (host RSS for the CPU backend)."""

    allocated: int
    peak_allocated: int
    reserved: int

    def as_gib(self) -> dict[str, float]:
        return {k: round(v / 2**30, 3) for k, v in self.__dict__.items()}


class HostStream:
    """A stream on a device whose work completes in program order on the host (the CPU): every
    wait is already satisfied. Backends with real queues return their own stream objects."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_event(self, event: object) -> None:
        pass

    def wait_stream(self, stream: object) -> None:
        pass

    def record_event(self, event: HostEvent | None = None) -> HostEvent:
        event = event or HostEvent()
        event.record()
        return event

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class HostEvent:
    """An event on a host-synchronous device: recorded = completed; keeps time for elapsed_time."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self._time: float | None = None

    def record(self, stream: object = None) -> None:
        self._time = time.perf_counter()

    def wait(self, stream: object = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: HostEvent) -> float:
        return (end._time - self._time) * 1000.0  # milliseconds, like torch.cuda.Event


class Accelerator(abc.ABC):
    """One device family (CUDA, CPU, an out-of-tree accelerator such as Kunlun XPU).

    A backend is a subclass registered under the ``loong.accelerators`` entry-point group.
    Instances are cheap, stateless views of the device; create one with
    :func:`loong_xpu.get_accelerator`.
    """

    #: name used by ``LOONG_DEVICE`` and the entry point.
    name: str = ""
    #: the ``torch.device`` type tensors live on (``"cuda"``, ``"cpu"``, ``"xpu"`` ...).
    device_type: str = ""
    #: the torch.distributed backend for collectives between devices of this family.
    dist_backend: str = ""
    #: ``LOONG_DEVICE=auto`` takes the available backend with the highest priority.
    priority: int = 0
    #: True when megatron-core's hard-coded CUDA calls must be redirected to this device
    #: (see :mod:`loong_xpu.patches`). False only for CUDA itself.
    needs_cuda_redirect: bool = True
    #: the optional :data:`FEATURES` this backend has.
    features: frozenset[str] = frozenset()

    @classmethod
    @abc.abstractmethod
    def is_available(cls) -> bool:
        """Whether this machine has a usable device of this family."""

    # --- devices -------------------------------------------------------------------------
    def device_count(self) -> int:
        return 1

    def current_device_index(self) -> int:
        return 0

    def set_device(self, index: int) -> None:
        """Bind this process to device ``index`` (the local rank under torchrun)."""

    def device(self, index: int | None = None) -> torch.device:
        if index is None:
            index = self.current_device_index()
        return torch.device(self.device_type, index)

    def synchronize(self) -> None:
        """Wait for all queued work on the current device."""

    # --- streams and events (host-synchronous defaults) --------------------------------------
    Stream: type = HostStream
    Event: type = HostEvent

    def current_stream(self) -> object:
        return HostStream()

    def stream(self, stream: object) -> contextlib.AbstractContextManager:
        """Context manager making ``stream`` current."""
        return contextlib.nullcontext()

    def set_stream(self, stream: object) -> None:
        pass

    def empty_cache(self) -> None:
        """Release cached, unused device memory."""

    # --- random numbers ------------------------------------------------------------------
    @abc.abstractmethod
    def get_rng_state(self) -> torch.Tensor:
        """The state of the current device's default generator."""

    @abc.abstractmethod
    def set_rng_state(self, state: torch.Tensor) -> None: ...

    @abc.abstractmethod
    def manual_seed(self, seed: int) -> None: ...

    # --- collectives and patches ----------------------------------------------------------
    def prepare_distributed(self) -> None:
        """Called before the process group is created: register a vendor collective backend
        (``torch.distributed.Backend.register_backend``) named :attr:`dist_backend` here."""

    def extra_patches(self) -> tuple:
        """Backend-specific :class:`~loong_xpu.patches.Patch` entries, applied after the shared
        manifest by :func:`~loong_xpu.redirect_cuda` and undone with it."""
        return ()

    # --- capabilities --------------------------------------------------------------------
    def supports(self, feature: str) -> bool:
        if feature not in FEATURES:
            raise ValueError(f"unknown accelerator feature {feature!r}; known: {', '.join(FEATURES)}")
        return feature in self.features

    def require(self, feature: str, key: str) -> None:
        """Raise :class:`UnsupportedFeatureError` naming ``key`` unless this backend has ``feature``."""
        if not self.supports(feature):
            has = ", ".join(sorted(self.features)) or "none"
            raise UnsupportedFeatureError(
                f"{key}: the {self.name!r} accelerator does not support {feature!r} (its features: {has})"
            )

    def fp8_recipes(self) -> frozenset[str]:
        """The FP8 scaling recipes (megatron's fp8_recipe names) the current device runs; empty
        without FP8 GEMMs."""
        return frozenset()

    def device_name(self) -> str:
        """The current device's model name (what a measured policy or benchmark is tied to)."""
        return self.name

    @abc.abstractmethod
    def memory_stats(self) -> MemoryStats: ...

    def reset_peak_memory_stats(self) -> None:
        """Start a new peak-memory window (no-op where the device cannot)."""

    def peak_flops(self, dtype: torch.dtype = torch.bfloat16) -> float | None:
        """Dense matmul peak FLOP/s of one device for ``dtype``; None when unknown.

        ``LOONG_PEAK_FLOPS`` overrides the table (e.g. for a new chip).
        """
        override = os.environ.get("LOONG_PEAK_FLOPS")
        return float(override) if override else None

    @property
    def preferred_dtype(self) -> torch.dtype:
        """The dtype training should compute in by default on this device."""
        return torch.float32

    def describe(self) -> str:
        return f"{self.name} ({self.device_type}, {self.device_count()} device(s), {self.dist_backend})"

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.describe()}>"
