"""The one place that chooses how a kernel runs: Loong's TileLang kernel, megatron-core's, or the torch reference.

Every op calls :func:`call` with a kernel name from :data:`KERNELS`. The TileLang version runs
when the inputs live on the device of loong-xpu's accelerator, that accelerator is CUDA,
``tilelang`` imports, the dtype is half precision and the kernel's ``supports`` accepts the
shapes; otherwise the reference runs.

Ops with several fast implementations (:data:`TUNED`: DSA's indexer top-k and sparse MLA, whose
forward and backward must come from the same one, and linear + cross-entropy, whose chunked torch
reference is itself a fast candidate) are measured instead: :func:`choose_op` has the current
:class:`Dispatcher`'s :class:`~loong_kernels.autotune.Autotuner` time every implementation that
can run the call, on its real inputs, once per shape bucket, and keeps the fastest that agrees
with the reference (the decision table is logged; ranks agree on rank 0's choice).

``LOONG_KERNELS_IMPL=reference|tilelang|megatron|auto`` (or :func:`use_implementation`)
overrides both choices, e.g. to benchmark one against the other; a forced implementation that
cannot run raises. ``megatron`` applies to the kernels that have a megatron-core version; the
others keep their automatic choice.
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
from loong_kernels.autotune import Autotuner
from loong_kernels.tilelang_support import tilelang_importable

Implementation = Literal["tilelang", "megatron", "reference"]
ENV_VAR = "LOONG_KERNELS_IMPL"
_CHOICES = ("auto", "tilelang", "megatron", "reference")
IMPLEMENTATIONS: tuple[Implementation, ...] = ("reference", "tilelang", "megatron")
# The kernels are written for 16-bit inputs with float32 accumulation.
TILELANG_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class KernelEntry:
    """``module:function`` paths, imported only when first chosen."""

    reference: str
    tilelang: str | None = None
    #: predicate over the call's arguments; the TileLang kernel runs only where it returns True
    supports: str | None = None
    #: megatron-core's kernel behind the same signature, and why it cannot run a call (str) or None
    megatron: str | None = None
    megatron_blocker: str | None = None


_REF = "loong_kernels.reference"
_TL = "loong_kernels.tl"
_MC = "loong_kernels.megatron_dsa"
KERNELS: dict[str, KernelEntry] = {
    "rms_norm_fwd": KernelEntry(f"{_REF}.rms_norm:rms_norm_fwd", f"{_TL}.rms_norm:rms_norm_fwd", f"{_TL}.rms_norm:supports"),
    "rms_norm_bwd": KernelEntry(f"{_REF}.rms_norm:rms_norm_bwd", f"{_TL}.rms_norm:rms_norm_bwd", f"{_TL}.rms_norm:supports_bwd"),
    "swiglu_fwd": KernelEntry(f"{_REF}.swiglu:swiglu_fwd", f"{_TL}.swiglu:swiglu_fwd", f"{_TL}.swiglu:supports"),
    "swiglu_bwd": KernelEntry(f"{_REF}.swiglu:swiglu_bwd", f"{_TL}.swiglu:swiglu_bwd", f"{_TL}.swiglu:supports_bwd"),
    "qkv_rope_fwd": KernelEntry(f"{_REF}.qkv_rope:qkv_rope_fwd", f"{_TL}.qkv_rope:qkv_rope_fwd", f"{_TL}.qkv_rope:supports"),
    "qkv_rope_bwd": KernelEntry(f"{_REF}.qkv_rope:qkv_rope_bwd", f"{_TL}.qkv_rope:qkv_rope_bwd", f"{_TL}.qkv_rope:supports_bwd"),
    "linear_cross_entropy": KernelEntry(
        f"{_REF}.linear_cross_entropy:linear_cross_entropy_chunked",
        f"{_TL}.linear_cross_entropy:linear_cross_entropy", f"{_TL}.linear_cross_entropy:supports",
    ),  # fmt: skip
    "linear_cross_entropy_tokens": KernelEntry(
        f"{_REF}.linear_cross_entropy:linear_cross_entropy_tokens_chunked",
        f"{_TL}.linear_cross_entropy:linear_cross_entropy_tokens", f"{_TL}.linear_cross_entropy:supports",
    ),  # fmt: skip
    # FP8 GEMMs (torch._scaled_mm) around the same softmax kernel; the reference emulates them in float32
    "linear_cross_entropy_tokens_fp8": KernelEntry(
        f"{_REF}.linear_cross_entropy_fp8:linear_cross_entropy_tokens_fp8_chunked",
        f"{_TL}.linear_cross_entropy_fp8:linear_cross_entropy_tokens_fp8", f"{_TL}.linear_cross_entropy_fp8:supports",
    ),  # fmt: skip
    "indexer_scores": KernelEntry(f"{_REF}.dsa:indexer_scores", f"{_TL}.indexer:indexer_scores", f"{_TL}.indexer:supports_scores"),
    "indexer_topk": KernelEntry(
        f"{_REF}.dsa:indexer_topk", f"{_TL}.indexer:indexer_topk", f"{_TL}.indexer:supports_indexer_topk",
        f"{_MC}:indexer_topk", f"{_MC}:indexer_topk_blocker",
    ),  # fmt: skip
    "indexer_topk_logits_fwd": KernelEntry(
        f"{_REF}.dsa:indexer_topk_logits_fwd", f"{_TL}.indexer:indexer_topk_logits_fwd", f"{_TL}.indexer:supports_topk"
    ),
    "indexer_topk_logits_bwd": KernelEntry(
        f"{_REF}.dsa:indexer_topk_logits_bwd", f"{_TL}.indexer:indexer_topk_logits_bwd", f"{_TL}.indexer:supports_topk_bwd"
    ),
    "sparse_mla_fwd": KernelEntry(
        f"{_REF}.dsa:sparse_mla_fwd", f"{_TL}.sparse_mla:sparse_mla_fwd", f"{_TL}.sparse_mla:supports",
        f"{_MC}:sparse_mla_fwd", f"{_MC}:blocker",
    ),  # fmt: skip
    "sparse_mla_bwd": KernelEntry(
        f"{_REF}.dsa:sparse_mla_bwd", f"{_TL}.sparse_mla:sparse_mla_bwd", f"{_TL}.sparse_mla:supports_bwd",
        f"{_MC}:sparse_mla_bwd", f"{_MC}:blocker_bwd",
    ),  # fmt: skip
    "sparse_attention_head_mean_probs": KernelEntry(
        f"{_REF}.dsa:sparse_attention_head_mean_probs",
        f"{_TL}.sparse_mla:sparse_attention_head_mean_probs",
        f"{_TL}.sparse_mla:supports_probs",
    ),
}

_forced: contextvars.ContextVar[str | None] = contextvars.ContextVar("loong_kernels_impl", default=None)


@contextlib.contextmanager
def use_implementation(name: Literal["auto", "tilelang", "megatron", "reference"]) -> Iterator[None]:
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


# the one fallback worth a warning: a CUDA run that has a TileLang kernel but not the package
NO_TILELANG = "tilelang does not import"


def _tilelang_blocker(entry: KernelEntry, args: tuple[Any, ...]) -> str | None:
    """Why the TileLang kernel cannot run this call, or None when it can."""
    if entry.tilelang is None:
        return "it has no TileLang kernel"
    x = _first_tensor(args)
    if x.device.type != "cuda" or _accelerator_device_type() != "cuda":
        return f"the inputs are on {x.device.type} and the accelerator is {_accelerator_device_type()}"
    if not tilelang_importable():
        return NO_TILELANG
    if x.dtype not in TILELANG_DTYPES:
        return f"the dtype is {x.dtype}"
    if entry.supports is not None and not _load(entry.supports)(*args):
        return "the kernel does not support these shapes"
    return None


_NAMES = {"tilelang": "TileLang", "megatron": "megatron-core", "reference": "the reference"}


def _megatron_blocker(entry: KernelEntry, args: tuple[Any, ...]) -> str | None:
    """Why megatron-core's kernel cannot run this call, or None when it can."""
    if entry.megatron is None or entry.megatron_blocker is None:
        return "it has no megatron-core kernel"
    x = _first_tensor(args)
    if x.device.type != "cuda":
        return f"the inputs are on {x.device.type}"
    if not tilelang_importable():
        return NO_TILELANG
    return _load(entry.megatron_blocker)(*args)


def _blocker(impl: str, entry: KernelEntry, args: tuple[Any, ...]) -> str | None:
    if impl == "tilelang":
        return _tilelang_blocker(entry, args)
    return _megatron_blocker(entry, args) if impl == "megatron" else None


def _forced_impl(name: str, requested: str, entry: KernelEntry, args: tuple[Any, ...]) -> Implementation:
    """The overriding implementation, or an error saying why it cannot run."""
    reason = _blocker(requested, entry, args)
    if reason is not None:
        raise RuntimeError(f"{name}: {_NAMES[requested]} was requested but cannot run: {reason}")
    return requested  # type: ignore[return-value]


def _requested_for(entry: KernelEntry) -> str:
    """The override as it applies to this kernel."""
    requested = _requested()
    if requested == "megatron" and entry.megatron is None:
        return "auto"  # the override targets the kernels megatron-core has
    return requested


def choose(kernel: str, *args: Any) -> Implementation:
    """Which implementation :func:`call` would run for these arguments."""
    entry = KERNELS[kernel]
    requested = _requested_for(entry)
    if requested != "auto":
        return _forced_impl(kernel, requested, entry, args)
    blocker = _tilelang_blocker(entry, args)
    if blocker is None:
        return "tilelang"
    _log_fallback(kernel, blocker)
    return "reference"


def runs_tilelang(kernel: str, *args: Any) -> bool:
    """Whether :func:`call` would run ``kernel``'s TileLang version for these arguments; no
    fallback warning (for a caller with a fast alternative of its own to the reference)."""
    entry = KERNELS[kernel]
    return _requested_for(entry) in ("auto", "tilelang") and _tilelang_blocker(entry, args) is None


@functools.cache
def _log_fallback(kernel: str, reason: str) -> None:
    if NO_TILELANG in reason:  # e.g. the fused output loss then runs slower than megatron's unfused one
        logger.warning("%s: the inputs are on CUDA but tilelang does not import, so the slower torch reference "
                       "runs instead of the TileLang kernel (pip install loong-kernels[tilelang])", kernel)  # fmt: skip
        return
    logger.debug("%s: using the torch reference because %s", kernel, reason)


def _path(impl: str, entry: KernelEntry) -> str:
    path = {"tilelang": entry.tilelang, "megatron": entry.megatron}.get(impl, entry.reference)
    if path is None:
        raise RuntimeError(f"there is no {_NAMES[impl]} version of {entry.reference}")
    return path


def call(kernel: str, *args: Any) -> Any:
    """Run ``kernel`` with the implementation :func:`choose` picks."""
    return call_with(choose(kernel, *args), kernel, *args)


def call_with(impl: Implementation, kernel: str, *args: Any) -> Any:
    """Run ``kernel`` with ``impl`` (e.g. a backward with the implementation its forward ran)."""
    return _load(_path(impl, KERNELS[kernel]))(*args)


@dataclass(frozen=True)
class TunedOp:
    """Kernels that run together with one implementation, chosen by measurement; ``module:function`` paths."""

    kernels: tuple[str, ...]  # the first one's arguments are the op's: its blockers decide who races
    trial: str  # (kernels: {name: fn}, *args) -> a step running them on args, returning what to compare
    key: str  # (*args) -> the shape bucket
    check: str  # (outputs, reference outputs) -> disagreement, e.g. loong_kernels.agreement:rel_diff
    tol: float


TUNED: dict[str, TunedOp] = {
    "sparse_mla": TunedOp(
        ("sparse_mla_fwd", "sparse_mla_bwd"), "loong_kernels.ops.dsa_tuning:sparse_mla_trial",
        "loong_kernels.ops.dsa_tuning:sparse_mla_bucket", "loong_kernels.agreement:rel_diff", 2e-2,
    ),  # fmt: skip
    # the same bf16 logits and gradients, chunked differently: dW is rounded to bf16 once per chunk,
    # noise that grows with the chunk count (agreement.summed_rel_diff: the norm within 5e-2, no entry
    # off by more than 0.2 of the largest; max |a - b| within 2e-2 rejected TileLang on an H100)
    "linear_cross_entropy": TunedOp(
        ("linear_cross_entropy",), "loong_kernels.ops.linear_cross_entropy_tuning:trial",
        "loong_kernels.ops.linear_cross_entropy_tuning:bucket", "loong_kernels.agreement:summed_rel_diff", 5e-2,
    ),  # fmt: skip
    # the per-token form (the output layer's loss in training): the same chunk loop, raced apart
    "linear_cross_entropy_tokens": TunedOp(
        ("linear_cross_entropy_tokens",), "loong_kernels.ops.linear_cross_entropy_tuning:trial",
        "loong_kernels.ops.linear_cross_entropy_tuning:bucket", "loong_kernels.agreement:summed_rel_diff", 5e-2,
    ),  # fmt: skip
    # bf16 scores round near-ties differently: up to 1% of the keys may differ from the reference's
    "indexer_topk": TunedOp(
        ("indexer_topk",), "loong_kernels.ops.dsa_tuning:indexer_topk_trial",
        "loong_kernels.ops.dsa_tuning:indexer_topk_bucket", "loong_kernels.agreement:missed_fraction", 1e-2,
    ),  # fmt: skip
}


def op_kernels(op: str, impl: Implementation) -> dict[str, Callable[..., Any]]:
    """The functions of ``impl`` for each kernel of the tuned ``op`` (what its trial runs)."""
    return {k: _load(_path(impl, KERNELS[k])) for k in TUNED[op].kernels}


class Dispatcher:
    """Chooses the implementation of :data:`TUNED` ops; owns the :class:`Autotuner` whose cache
    holds the measured decisions. The package's dispatcher lives for the process;
    :func:`use_dispatcher` puts another in charge inside a block (a fresh one measures anew)."""

    def __init__(self, autotuner: Autotuner | None = None) -> None:
        self.autotuner = autotuner or Autotuner()

    def choose_op(self, op: str, *args: Any) -> Implementation:
        """The implementation for ``op`` on these arguments (the override, else the measured winner)."""
        tuned = TUNED[op]
        entry = KERNELS[tuned.kernels[0]]
        requested = _requested()
        if requested == "megatron" and entry.megatron is None:
            requested = "auto"  # as in choose(): the override targets the kernels megatron-core has
        if requested != "auto":
            return _forced_impl(op, requested, entry, args)
        x = _first_tensor(args)
        device = torch.cuda.get_device_name(x.device) if x.is_cuda else x.device.type
        key = (op, *_load(tuned.key)(*args), str(x.dtype).removeprefix("torch."), device)
        # a decided shape returns at once: this runs in every DSA layer's forward, and building the
        # trials allocates (sparse MLA's output gradient per implementation)
        if (decided := self.autotuner.cache.get(key)) is not None:
            return decided.winner  # type: ignore[return-value]
        blocked = {impl: why for impl in IMPLEMENTATIONS if (why := _blocker(impl, entry, args)) is not None}
        runnable = [impl for impl in IMPLEMENTATIONS if impl not in blocked]
        if runnable == ["reference"]:
            _log_fallback(op, "; ".join(f"{_NAMES[i]}: {why}" for i, why in blocked.items()))
            return "reference"
        trial = _load(tuned.trial)
        steps = {impl: trial(op_kernels(op, impl), *args) for impl in runnable}
        check = _load(tuned.check)
        # if the reference cannot run (e.g. out of memory) nothing can be checked: the static choice
        fallback = "tilelang" if "tilelang" in runnable else runnable[-1]
        return self.autotuner.pick(  # type: ignore[return-value]
            key, steps, reference="reference", check=check, tol=tuned.tol, skipped=blocked, fallback=fallback
        )


_PROCESS_DISPATCHER = Dispatcher()
_dispatcher: contextvars.ContextVar[Dispatcher | None] = contextvars.ContextVar("loong_kernels_dispatcher", default=None)


def current_dispatcher() -> Dispatcher:
    """The dispatcher in charge: :func:`use_dispatcher`'s, else the process-wide one."""
    return _dispatcher.get() or _PROCESS_DISPATCHER


@contextlib.contextmanager
def use_dispatcher(dispatcher: Dispatcher) -> Iterator[Dispatcher]:
    """Make ``dispatcher`` (and its decision cache) the one in charge inside the block."""
    token = _dispatcher.set(dispatcher)
    try:
        yield dispatcher
    finally:
        _dispatcher.reset(token)


def choose_op(op: str, *args: Any) -> Implementation:
    """:meth:`Dispatcher.choose_op` of the dispatcher in charge."""
    return current_dispatcher().choose_op(op, *args)
