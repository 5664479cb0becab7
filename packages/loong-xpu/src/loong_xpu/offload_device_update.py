"""megatron's host-offloaded optimizer, its offloaded share updated on the device.

With ``optim.offload_fraction`` megatron's ``HybridDeviceOptimizer`` keeps the offloaded share's
fp32 master weights and Adam moments in host memory and updates them there with torch's fused CPU
AdamW. Each step the gradients go to the host, the host kernel reads and writes 28 bytes a
parameter, and the masters come back. On a 4-GPU host the four processes' updates are bound by the
host's memory bandwidth (~0.5 s a step for 0.78B parameters per GPU, profiled at EP=4), and the
GPUs wait.

With ``optim.offload_update=device`` (Loong's default) the state stays in pinned host memory, so
the GPU holds no more than with the host update, but each step it is streamed through the GPU in
chunks: a chunk of masters and moments goes to the device on a side stream, torch's fused AdamW
(the CUDA build of the kernel the host runs, same formula) updates it against the gradient where
the gradient already is and writes the bf16 weight, and the chunk goes back on another side stream
while the next one is updated. The host moves 24 bytes a parameter by DMA and computes nothing.

The moments may be kept in bf16 on the host (``update_on_device(optimizer, moments=torch.bfloat16)``,
Loong's ``optim.state_dtype=bf16``): they travel as bf16 and are widened to fp32 on the device for
the update, then rounded back, as Transformer Engine's FusedAdam keeps bf16 moments. That is 16
bytes a parameter by DMA instead of 24, and half the host memory for the moments; the update is
bound by the host link (one H200: ~42 GB/s in, ~49 GB/s out, both at once), so it takes a third
less time.

The manifest wraps ``HybridDeviceOptimizer.step``; an optimizer marked by :func:`update_on_device`
takes this path, any other megatron's. The state keeps torch AdamW's layout (``step``, ``exp_avg``,
``exp_avg_sq`` per host master), so checkpoints load into either path. ``step`` returns once the
host state is written back: a checkpoint saved after it reads finished tensors.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from loong_xpu.offload_buckets import buckets

TARGET = "megatron.core.optimizer.cpu_offloading.hybrid_optimizer:HybridDeviceOptimizer.step"
MARK = "loong_update_on_device"  # the attribute update_on_device sets on a HybridDeviceOptimizer: the moments' dtype
CHUNK = 1 << 24  # elements staged at once (64 MiB of fp32 for each of master, exp_avg, exp_avg_sq)
SLOTS = 3  # chunks in flight: one arriving, one being updated, one going back


@dataclass
class Piece:
    """One offloaded tensor, or a run of ``CHUNK`` elements of it: host state and device tensors."""

    master: torch.Tensor  # host, fp32
    exp_avg: torch.Tensor  # host, fp32 or bf16 (widened to fp32 on the device for the update)
    exp_avg_sq: torch.Tensor  # host, as exp_avg
    grad: torch.Tensor  # device
    weight: torch.Tensor  # device (bf16 in megatron's precision-aware optimizer)
    step: float  # Adam's step count for this update (already incremented)
    hyper: tuple[float, float, float, float, float]  # lr, beta1, beta2, weight_decay, eps

    def numel(self) -> int:
        return self.master.numel()


def adam_state(optimizer: torch.optim.Optimizer, master: torch.Tensor,
               moments: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:  # fmt: skip
    """``optimizer``'s AdamW state of ``master`` as torch's fused AdamW keeps it, the moments in
    ``moments`` and in pinned memory (created at zero on the first step; a state loaded from a
    checkpoint is cast and pinned in place, so one written with other moments loads)."""
    state = optimizer.state[master]
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32)
        for key in ("exp_avg", "exp_avg_sq"):
            state[key] = torch.zeros(master.shape, dtype=moments, pin_memory=torch.cuda.is_available())
    for key in ("exp_avg", "exp_avg_sq"):
        tensor = state[key]
        if tensor.dtype != moments:
            tensor.data = tensor.data.to(moments)  # same object: the HDO's own state map holds it
        if torch.cuda.is_available() and not tensor.is_pinned():
            tensor.data = tensor.data.pin_memory()
    return state


def split(piece: Piece, limit: int) -> Iterator[Piece]:
    """``piece`` as runs of at most ``limit`` elements (flat views; a non-contiguous device tensor
    stays whole and must fit)."""
    n = piece.master.numel()
    if n <= limit:
        yield piece
        return
    if not (piece.weight.is_contiguous() and piece.grad.is_contiguous() and piece.master.is_contiguous()):
        raise ValueError(f"loong_xpu.offload_device_update: a non-contiguous offloaded tensor of {n} elements "
                         f"is larger than a staged chunk ({limit}); it cannot be updated on the device")  # fmt: skip
    flat = [t.reshape(-1) for t in (piece.master, piece.exp_avg, piece.exp_avg_sq, piece.grad, piece.weight)]
    for start in range(0, n, limit):
        views = [t[start : start + limit] for t in flat]
        yield Piece(*views, step=piece.step, hyper=piece.hyper)


@dataclass
class Staged:
    """One piece's place in a staging slot: the fp32 tensors the update runs on (master, exp_avg,
    exp_avg_sq) and what travels to and from the host for each (the same tensor, or for moments
    kept narrower on the host a view of the slot's buffer in their dtype)."""

    compute: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    wire: tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class StagedAdamW:
    """Updates :class:`Piece` s through ``SLOTS`` staging buffers of ``chunk`` elements on ``device``:
    host state in, torch's fused AdamW and the weight cast on the device, host state out. Moments
    kept in bf16 on the host travel as bf16 and are widened for the update and rounded back on the
    device. On CUDA the copies run on ``streams`` (in, out) beside the current stream, which
    updates; elsewhere (tests on the CPU) everything runs in order."""

    def __init__(self, device: torch.device, streams: tuple[Any, Any] | None = None, chunk: int | None = None) -> None:
        self.device, self.streams, self.chunk = device, streams, chunk or CHUNK  # CHUNK read now: tests lower it

    def update(self, pieces: list[Piece]) -> None:
        runs = buckets([p for piece in pieces for p in split(piece, self.chunk)], self.chunk)
        if not runs:
            return
        narrow = {t.dtype for p in pieces for t in (p.exp_avg, p.exp_avg_sq)} - {torch.float32}
        if len(narrow) > 1:
            raise ValueError(f"loong_xpu.offload_device_update: the offloaded moments are in several dtypes "
                             f"({', '.join(sorted(map(str, narrow)))}); expected one")  # fmt: skip
        slots = [self._slot(next(iter(narrow), None)) for _ in range(min(SLOTS, len(runs)))]
        cuda = self.streams is not None
        current = torch.cuda.current_stream(self.device) if cuda else None
        if cuda:
            self.streams[0].wait_stream(current)  # the slots' memory may still be read by earlier work
        freed: list[Any] = [None] * len(slots)
        for i, run in enumerate(runs):
            slot = i % len(slots)
            staged = self._views(run, *slots[slot])
            if cuda:
                if freed[slot] is not None:
                    self.streams[0].wait_event(freed[slot])
                with torch.cuda.stream(self.streams[0]):
                    self._copy(run, staged, to_device=True)
                current.wait_event(self.streams[0].record_event())
            else:
                self._copy(run, staged, to_device=True)
            self._adamw(run, staged)
            if cuda:
                self.streams[1].wait_event(current.record_event())
                with torch.cuda.stream(self.streams[1]):
                    self._copy(run, staged, to_device=False)
                    freed[slot] = self.streams[1].record_event()
            else:
                self._copy(run, staged, to_device=False)
        if cuda:
            self.streams[1].synchronize()  # the host state is whole before step() returns

    def _slot(self, narrow: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        compute = torch.empty((3, self.chunk), dtype=torch.float32, device=self.device)
        wire = None if narrow is None else torch.empty((2, self.chunk), dtype=narrow, device=self.device)
        return compute, wire

    @staticmethod
    def _views(run: list[Piece], compute: torch.Tensor, wire: torch.Tensor | None) -> list[Staged]:
        staged, start = [], 0
        for piece in run:
            n, shape = piece.master.numel(), piece.master.shape
            fp32 = tuple(compute[k, start : start + n].view(shape) for k in range(3))
            travel = [fp32[0]]
            for k, moment in enumerate((piece.exp_avg, piece.exp_avg_sq)):
                travel.append(fp32[1 + k] if moment.dtype == torch.float32 else wire[k, start : start + n].view(shape))
            staged.append(Staged(fp32, tuple(travel)))
            start += n
        return staged

    @staticmethod
    def _copy(run: list[Piece], staged: list[Staged], *, to_device: bool) -> None:
        for piece, views in zip(run, staged, strict=True):
            for host, dev in zip((piece.master, piece.exp_avg, piece.exp_avg_sq), views.wire, strict=True):
                if to_device:
                    dev.copy_(host, non_blocking=True)
                else:
                    host.copy_(dev, non_blocking=True)

    def _adamw(self, run: list[Piece], staged: list[Staged]) -> None:
        for views in staged:  # narrow moments widened for the update
            for fp32, travel in zip(views.compute, views.wire, strict=True):
                if travel is not fp32:
                    fp32.copy_(travel)
        by_hyper: dict[tuple, list[int]] = {}
        for i, piece in enumerate(run):
            by_hyper.setdefault((piece.hyper, piece.step), []).append(i)
        for ((lr, beta1, beta2, weight_decay, eps), step), idx in by_hyper.items():
            steps = [torch.full((), step, dtype=torch.float32, device=self.device)] * len(idx)
            grads = [run[i].grad if run[i].grad.dtype == torch.float32 else run[i].grad.float() for i in idx]
            torch._fused_adamw_([staged[i].compute[0] for i in idx], grads, [staged[i].compute[1] for i in idx],
                                [staged[i].compute[2] for i in idx], [], steps, lr=lr, beta1=beta1, beta2=beta2,
                                weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)  # fmt: skip
        for piece, views in zip(run, staged, strict=True):
            piece.weight.copy_(views.compute[0])  # the bf16 weight, rounded from the updated master
            for fp32, travel in zip(views.compute, views.wire, strict=True):
                if travel is not fp32:
                    travel.copy_(fp32)  # narrow moments rounded back (to nearest, as TE's FusedAdam)


def offloaded_pieces(hdo: Any, moments: torch.dtype = torch.float32) -> list[Piece]:
    """The offloaded share of ``hdo`` (a ``HybridDeviceOptimizer``) as pieces to update, each host
    optimizer's step counts advanced, the moments kept in ``moments``, in megatron's order; a tensor
    without a gradient is skipped, as torch's AdamW skips it."""
    pieces = []
    for optimizer in hdo.cpu_optimizers:
        for group in optimizer.param_groups:
            if group.get("amsgrad") or group.get("maximize"):
                raise ValueError("loong_xpu.offload_device_update: the offloaded AdamW has amsgrad or maximize set, "
                                 "which the device update does not run")  # fmt: skip
            beta1, beta2 = group["betas"]
            hyper = (float(group["lr"]), float(beta1), float(beta2), float(group["weight_decay"]), float(group["eps"]))
            for master in group["params"]:
                weight = hdo.cpu_copys_map_gpu_param[master]
                grad = getattr(weight, "decoupled_grad", weight.grad)
                if grad is None:
                    continue
                state = adam_state(optimizer, master, moments)
                state["step"] += 1
                pieces.append(Piece(master, state["exp_avg"], state["exp_avg_sq"], grad, weight.data,
                                    step=float(state["step"]), hyper=hyper))  # fmt: skip
    return pieces


def device_step(hdo: Any, moments: torch.dtype = torch.float32) -> None:
    """``HybridDeviceOptimizer.step`` with the offloaded share updated on the device: megatron's
    parameter-group sync and device share as in its own step, then :class:`StagedAdamW` over the
    host share (no gradients go to the host; its moments kept in ``moments``), then megatron's
    state sync."""
    hdo._sync_hdo_param_groups_to_sub_optimizers()
    cpu_optimizers, hdo.cpu_optimizers = hdo.cpu_optimizers, []
    try:  # megatron's gradient hand-over for the device share only
        hdo._d2h_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(hdo._d2h_stream):
            hdo._set_sub_optimizer_grads()
    finally:
        hdo.cpu_optimizers = cpu_optimizers
    if hdo.gpu_optimizer:
        hdo.gpu_optimizer.step()
    pieces = offloaded_pieces(hdo, moments)
    if pieces:
        device = pieces[0].weight.device
        StagedAdamW(device, streams=(hdo._h2d_stream, hdo._d2h_stream)).update(pieces)
    hdo._sync_sub_optimizers_state_to_hdo()


def make_step(accel: object = None):
    """The method the manifest puts in place of ``HybridDeviceOptimizer.step``: :func:`device_step`
    for an optimizer marked by :func:`update_on_device`, megatron's step for any other."""
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    original = HybridDeviceOptimizer.step

    @functools.wraps(original)
    def step(self, closure=None):
        moments = getattr(self, MARK, None)
        if moments is None:
            return original(self, closure)
        if closure is not None:
            raise ValueError("loong_xpu.offload_device_update: the device update takes no closure")
        device_step(self, moments)
        return None

    return step


def update_on_device(optimizer: Any, moments: torch.dtype = torch.float32) -> int:
    """Marks every ``HybridDeviceOptimizer`` inside megatron's ``optimizer`` (a chained or
    distributed optimizer, or one itself) for the device update, its offloaded Adam moments kept
    in ``moments`` (fp32 or bf16) on the host; returns how many. Raises where the manifest's patch
    of ``HybridDeviceOptimizer.step`` is not in place, or for another ``moments``."""
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    from loong_xpu.patches import is_applied

    if not is_applied(TARGET):
        raise RuntimeError(f"loong_xpu.offload_device_update needs the manifest's patch of {TARGET} "
                           "(build and step the optimizer inside loong_xpu.redirect_cuda)")  # fmt: skip
    if moments not in (torch.float32, torch.bfloat16):
        raise ValueError(f"loong_xpu.offload_device_update: moments={moments}; expected torch.float32 or torch.bfloat16")
    found, stack = 0, [optimizer]
    while stack:
        opt = stack.pop()
        if isinstance(opt, HybridDeviceOptimizer):
            setattr(opt, MARK, moments)
            found += 1
            continue
        chained = getattr(opt, "chained_optimizers", None)
        if chained is not None:  # a ChainedOptimizer's .optimizer refuses to pick one of several
            stack.extend(chained)
            continue
        inner = getattr(opt, "optimizer", None)
        if inner is not None and inner is not opt:
            stack.append(inner)
    return found
