"""The one place that chooses between a TileLang kernel and its torch reference.

Every op calls :func:`call` with a kernel name from :data:`KERNELS`. The TileLang version runs
when the inputs live on the device of loong-xpu's accelerator, that accelerator is CUDA,
``tilelang`` imports, the dtype is half precision and the kernel's ``supports`` accepts the
shapes; otherwise the reference runs. ``LOONG_KERNELS_IMPL=reference|tilelang|auto`` (or
:func:`use_implementation`) overrides the choice, e.g. to benchmark one against the other.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch

from loong_kernels._log import logger
from loong_kernels.tilelang_support import tilelang_importable

Implementation = Literal["tilelang", "reference"]
ENV_VAR = "LOONG_KERNELS_IMPL"
_CHOICES = ("auto", "tilelang", "reference")
# The kernels are written for 16-bit inputs with float32 accumulation.
TILELANG_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class KernelEntry:
    """``module:function`` paths, imported only when first chosen."""

    reference: str
    tilelang: str | None = None
    #: predicate over the call's arguments; the TileLang kernel runs only where it returns True
    supports: str | None = None


_REF = "loong_kernels.reference"
_TL = "loong_kernels.tl"
KERNELS: dict[str, KernelEntry] = {
    "rms_norm_fwd": KernelEntry(f"{_REF}.rms_norm:rms_norm_fwd", f"{_TL}.rms_norm:rms_norm_fwd", f"{_TL}.rms_norm:supports"),
    "rms_norm_bwd": KernelEntry(f"{_REF}.rms_norm:rms_norm_bwd", f"{_TL}.rms_norm:rms_norm_bwd", f"{_TL}.rms_norm:supports_bwd"),
    "swiglu_fwd": KernelEntry(f"{_REF}.swiglu:swiglu_fwd", f"{_TL}.swiglu:swiglu_fwd", f"{_TL}.swiglu:supports"),
    "swiglu_bwd": KernelEntry(f"{_REF}.swiglu:swiglu_bwd", f"{_TL}.swiglu:swiglu_bwd", f"{_TL}.swiglu:supports_bwd"),
    # chunking is the memory win; the chunks are cuBLAS matmuls, so there is no TileLang version
    "linear_cross_entropy": KernelEntry(f"{_REF}.linear_cross_entropy:linear_cross_entropy_chunked"),
    "indexer_scores": KernelEntry(f"{_REF}.dsa:indexer_scores", f"{_TL}.indexer:indexer_scores", f"{_TL}.indexer:supports_scores"),
    "indexer_topk_logits_fwd": KernelEntry(
        f"{_REF}.dsa:indexer_topk_logits_fwd", f"{_TL}.indexer:indexer_topk_logits_fwd", f"{_TL}.indexer:supports_topk"
    ),
    "indexer_topk_logits_bwd": KernelEntry(
        f"{_REF}.dsa:indexer_topk_logits_bwd", f"{_TL}.indexer:indexer_topk_logits_bwd", f"{_TL}.indexer:supports_topk_bwd"
    ),
    "sparse_mla_fwd": KernelEntry(f"{_REF}.dsa:sparse_mla_fwd", f"{_TL}.sparse_mla:sparse_mla_fwd", f"{_TL}.sparse_mla:supports"),
    "sparse_mla_bwd": KernelEntry(f"{_REF}.dsa:sparse_mla_bwd", f"{_TL}.sparse_mla:sparse_mla_bwd", f"{_TL}.sparse_mla:supports_bwd"),
    "sparse_attention_head_mean_probs": KernelEntry(
        f"{_REF}.dsa:sparse_attention_head_mean_probs",
        f"{_TL}.sparse_mla:sparse_attention_head_mean_probs",
        f"{_TL}.sparse_mla:supports_probs",
    ),
}

_forced: contextvars.ContextVar[str | None] = contextvars.ContextVar("loong_kernels_impl", default=None)


@contextlib.contextmanager
def use_implementation(name: Literal["auto", "tilelang", "reference"]) -> Iterator[None]:
    """Force an implementation inside the block (``tilelang`` raises where it cannot run)."""
    if name not in _CHOICES:
        raise ValueError(f"implementation must be one of {_CHOICES}, got {name!r}")
    token = _forced.set(name)
    try:
        yield
    finally:
        _forced.reset(token)


def _requested() -> str:
    name = _forced.get() or os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if name not in _CHOICES:
        raise ValueError(f"{ENV_VAR}={name!r}; allowed: {', '.join(_CHOICES)}")
    return name


@functools.cache
def _load(path: str) -> Callable[..., Any]:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


@functools.cache
def _accelerator_device_type() -> str:
    from loong_xpu import get_accelerator

    return get_accelerator().device_type


def _first_tensor(args: tuple[Any, ...]) -> torch.Tensor:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
    raise TypeError("a kernel call needs at least one tensor argument")


def _tilelang_blocker(entry: KernelEntry, args: tuple[Any, ...]) -> str | None:
    """Why the TileLang kernel cannot run this call, or None when it can."""
    if entry.tilelang is None:
        return "it has no TileLang kernel"
    x = _first_tensor(args)
    if x.device.type != "cuda" or _accelerator_device_type() != "cuda":
        return f"the inputs are on {x.device.type} and the accelerator is {_accelerator_device_type()}"
    if not tilelang_importable():
        return "tilelang does not import"
    if x.dtype not in TILELANG_DTYPES:
        return f"the dtype is {x.dtype}"
    if entry.supports is not None and not _load(entry.supports)(*args):
        return "the kernel does not support these shapes"
    return None


def choose(kernel: str, *args: Any) -> Implementation:
    """Which implementation :func:`call` would run for these arguments."""
    entry = KERNELS[kernel]
    requested = _requested()
    if requested == "reference":
        return "reference"
    blocker = _tilelang_blocker(entry, args)
    if blocker is None:
        return "tilelang"
    if requested == "tilelang":
        raise RuntimeError(f"{kernel}: TileLang was requested but cannot run: {blocker}")
    _log_fallback(kernel, blocker)
    return "reference"


@functools.cache
def _log_fallback(kernel: str, reason: str) -> None:
    logger.debug("%s: using the torch reference because %s", kernel, reason)


def call(kernel: str, *args: Any) -> Any:
    """Run ``kernel`` with the implementation :func:`choose` picks."""
    entry = KERNELS[kernel]
    impl = choose(kernel, *args)
    fn = _load(entry.tilelang if impl == "tilelang" else entry.reference)  # type: ignore[arg-type]
    return fn(*args)
