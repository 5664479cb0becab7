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

The master weights may stay on the device as their 16 low bits beside the bf16 weight
(``update_on_device(optimizer, remainders=True)``, Loong's ``optim.offload_master=remainder``), the
layout Transformer Engine's FusedAdam keeps them in on the GPU (:mod:`loong_xpu.master_remainder`):
the bf16 weight is then the master rounded to nearest with ties away from zero, as FusedAdam rounds
it, and the pair is the master bit for bit. Only the int16 low half travels, 2 bytes each way
instead of 4: 20 bytes a parameter by DMA with fp32 moments, 12 with bf16 ones, and 2 bytes a
parameter more on the host. megatron's fp32 host master then falls behind; it is written back
(:func:`write_back_masters`) before megatron reads it for a checkpoint or re-reads its state, and a
master megatron writes (a loaded checkpoint, ``reload_model_params``) is read from there on the next
step (three manifest wraps, below).

The manifest wraps ``HybridDeviceOptimizer.step``; an optimizer marked by :func:`update_on_device`
takes this path, any other megatron's. The state keeps torch AdamW's layout (``step``, ``exp_avg``,
``exp_avg_sq`` per host master), so checkpoints load into either path. ``step`` returns once the
host state is written back: a checkpoint saved after it reads finished tensors.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from loong_xpu.master_remainder import join_master, split_master_
from loong_xpu.offload_buckets import buckets

TARGET = "megatron.core.optimizer.cpu_offloading.hybrid_optimizer:HybridDeviceOptimizer.step"
MARK = "loong_update_on_device"  # the attribute update_on_device sets on a HybridDeviceOptimizer: the moments' dtype
REMAINDERS = "loong_master_remainders"  # and, with remainders=True, this one: its Remainders
_HDO = "megatron.core.optimizer.cpu_offloading.hybrid_optimizer:HybridDeviceOptimizer"
REMAINDER_TARGETS = (  # where megatron reads or writes its host masters: the wraps that keep them right
    f"{_HDO}._sync_hdo_state_to_sub_optimizers",
    f"{_HDO}.update_fp32_param_by_new_param",
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer._get_main_param_and_optimizer_states",
)
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
    # host, int16: the master's low 16 bits beside the bf16 weight (the remainder layout), where
    # the update reads the master from (unless master_in) and writes it to; None: master in and out
    remainder: torch.Tensor | None = None
    master_in: bool = True  # read the master from `master` (its remainder is not current yet)

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
    remainder = None if piece.remainder is None else piece.remainder.reshape(-1)
    for start in range(0, n, limit):
        views = [t[start : start + limit] for t in flat]
        yield Piece(*views, step=piece.step, hyper=piece.hyper, master_in=piece.master_in,
                    remainder=None if remainder is None else remainder[start : start + limit])  # fmt: skip


@dataclass
class Staged:
    """One piece's place in a staging slot: the fp32 tensors the update runs on (master, exp_avg,
    exp_avg_sq); the (host, slot) pairs that travel in and out (fp32 state as it is, moments kept
    narrower on the host through a view of the slot's buffer in their dtype, the master's low half
    through an int16 view); the (fp32, narrow) moment pairs widened before the update and rounded
    back after it; and the int16 view of the low half (None: the master travels whole)."""

    compute: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    inbound: list[tuple[torch.Tensor, torch.Tensor]]
    outbound: list[tuple[torch.Tensor, torch.Tensor]]
    narrow: list[tuple[torch.Tensor, torch.Tensor]]
    remainder: torch.Tensor | None


class StagedAdamW:
    """Updates :class:`Piece` s through ``SLOTS`` staging buffers of ``chunk`` elements on ``device``:
    host state in, torch's fused AdamW and the weight cast on the device, host state out. Moments
    kept in bf16 on the host travel as bf16 and are widened for the update and rounded back on the
    device; a master kept as its low half (a piece with a remainder) is joined with its weight
    before the update and split into both after it. On CUDA the copies run on ``streams`` (in, out)
    beside the current stream, which updates; elsewhere (tests on the CPU) everything runs in order."""

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
        remainders = any(p.remainder is not None for p in pieces)
        slots = [self._slot(next(iter(narrow), None), remainders) for _ in range(min(SLOTS, len(runs)))]
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
                    self._copy(staged, to_device=True)
                current.wait_event(self.streams[0].record_event())
            else:
                self._copy(staged, to_device=True)
            self._adamw(run, staged)
            if cuda:
                self.streams[1].wait_event(current.record_event())
                with torch.cuda.stream(self.streams[1]):
                    self._copy(staged, to_device=False)
                    freed[slot] = self.streams[1].record_event()
            else:
                self._copy(staged, to_device=False)
        if cuda:
            self.streams[1].synchronize()  # the host state is whole before step() returns

    def _slot(self, narrow: torch.dtype | None, remainders: bool) -> tuple[torch.Tensor, ...]:
        compute = torch.empty((3, self.chunk), dtype=torch.float32, device=self.device)
        wire = None if narrow is None else torch.empty((2, self.chunk), dtype=narrow, device=self.device)
        low = torch.empty(self.chunk, dtype=torch.int16, device=self.device) if remainders else None
        return compute, wire, low

    @staticmethod
    def _views(run: list[Piece], compute: torch.Tensor, wire: torch.Tensor | None,
               low: torch.Tensor | None) -> list[Staged]:  # fmt: skip
        staged, start = [], 0
        for piece in run:
            n, shape = piece.master.numel(), piece.master.shape
            fp32 = tuple(compute[k, start : start + n].view(shape) for k in range(3))
            moments, narrow = [], []
            for k, moment in enumerate((piece.exp_avg, piece.exp_avg_sq)):
                if moment.dtype == torch.float32:
                    moments.append((moment, fp32[1 + k]))
                else:
                    travel = wire[k, start : start + n].view(shape)
                    moments.append((moment, travel))
                    narrow.append((fp32[1 + k], travel))
            if piece.remainder is None:
                remainder = None
                inbound = outbound = [(piece.master, fp32[0])]
            else:
                remainder = low[start : start + n].view(shape)
                inbound = [(piece.master, fp32[0]) if piece.master_in else (piece.remainder, remainder)]
                outbound = [(piece.remainder, remainder)]  # megatron's host master falls behind
            staged.append(Staged(fp32, inbound + moments, outbound + moments, narrow, remainder))
            start += n
        return staged

    @staticmethod
    def _copy(staged: list[Staged], *, to_device: bool) -> None:
        for views in staged:
            for host, dev in views.inbound if to_device else views.outbound:
                if to_device:
                    dev.copy_(host, non_blocking=True)
                else:
                    host.copy_(dev, non_blocking=True)

    def _adamw(self, run: list[Piece], staged: list[Staged]) -> None:
        for piece, views in zip(run, staged, strict=True):
            for fp32, travel in views.narrow:  # narrow moments widened for the update
                fp32.copy_(travel)
            if views.remainder is not None and not piece.master_in:
                join_master(piece.weight, views.remainder, views.compute[0])
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
            if views.remainder is None:
                piece.weight.copy_(views.compute[0])  # the bf16 weight, rounded from the updated master
            else:  # the weight rounded as TE's FusedAdam rounds it, and the low half beside it
                split_master_(views.compute[0], piece.weight, views.remainder)
            for fp32, travel in views.narrow:
                travel.copy_(fp32)  # narrow moments rounded back (to nearest, as TE's FusedAdam)


@dataclass
class Remainders:
    """The offloaded masters' low halves, for an optimizer marked with ``remainders=True``: one
    pinned int16 host tensor per megatron host master (``tensors``), the masters whose low half,
    with its weight, is the master (``current``), and those whose megatron host master is behind
    it (``ahead``: updated on the device since megatron last read or wrote it)."""

    tensors: dict[torch.Tensor, torch.Tensor] = field(default_factory=dict)
    current: set[torch.Tensor] = field(default_factory=set)
    ahead: set[torch.Tensor] = field(default_factory=set)

    def low_half(self, master: torch.Tensor) -> torch.Tensor:
        if master not in self.tensors:
            self.tensors[master] = torch.empty(master.shape, dtype=torch.int16, pin_memory=torch.cuda.is_available())
        return self.tensors[master]


def offloaded_pieces(hdo: Any, moments: torch.dtype = torch.float32, remainders: Remainders | None = None) -> list[Piece]:
    """The offloaded share of ``hdo`` (a ``HybridDeviceOptimizer``) as pieces to update, each host
    optimizer's step counts advanced, the moments kept in ``moments``, in megatron's order; a tensor
    without a gradient is skipped, as torch's AdamW skips it. With ``remainders`` each piece keeps
    its master as the low half beside its (bf16) weight, read from megatron's host master while
    that low half is not current."""
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
                piece = Piece(master, state["exp_avg"], state["exp_avg_sq"], grad, weight.data,
                              step=float(state["step"]), hyper=hyper)  # fmt: skip
                if remainders is not None:
                    if weight.dtype != torch.bfloat16:
                        raise ValueError(f"loong_xpu.offload_device_update: an offloaded weight is {weight.dtype}; "
                                         "keeping the master as its low half beside the weight needs bf16 weights")  # fmt: skip
                    piece.remainder = remainders.low_half(master)
                    piece.master_in = master not in remainders.current
                pieces.append(piece)
    return pieces


def device_step(hdo: Any, moments: torch.dtype = torch.float32) -> None:
    """``HybridDeviceOptimizer.step`` with the offloaded share updated on the device: megatron's
    parameter-group sync and device share as in its own step, then :class:`StagedAdamW` over the
    host share (no gradients go to the host; its moments kept in ``moments``, its masters as low
    halves where ``hdo`` is marked so), then megatron's state sync."""
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
    remainders = getattr(hdo, REMAINDERS, None)
    pieces = offloaded_pieces(hdo, moments, remainders)
    if pieces:
        device = pieces[0].weight.device
        StagedAdamW(device, streams=(hdo._h2d_stream, hdo._d2h_stream)).update(pieces)
    if remainders is not None:
        updated = {p.master for p in pieces}
        remainders.current |= updated
        remainders.ahead |= updated
    hdo._sync_sub_optimizers_state_to_hdo()


def write_back_masters(hdo: Any, chunk: int | None = None) -> int:
    """Writes megatron's fp32 host masters of ``hdo`` that are behind their low halves (an optimizer
    marked with ``remainders=True``) from weight and low half, ``chunk`` elements at a time on the
    weights' device; returns how many. Then megatron's host state is whole (a checkpoint reads it)."""
    remainders = getattr(hdo, REMAINDERS, None)
    if remainders is None or not remainders.ahead:
        return 0
    chunk = chunk or CHUNK
    for master in remainders.ahead:
        weight = hdo.cpu_copys_map_gpu_param[master].data
        flat = [t.reshape(-1) for t in (master, weight, remainders.tensors[master])]  # a strided weight: copied
        for start in range(0, master.numel(), chunk):
            host, dev_weight, host_low = (t[start : start + chunk] for t in flat)
            joined = torch.empty(host.shape, dtype=torch.float32, device=weight.device)
            join_master(dev_weight, host_low.to(weight.device), joined)
            host.copy_(joined)
    written = len(remainders.ahead)
    remainders.ahead.clear()
    return written


def _host_masters_rewritten(hdo: Any) -> None:
    """megatron wrote ``hdo``'s host masters (a loaded state, weights reloaded): the low halves are
    stale, so the next step reads the masters from the host."""
    remainders = getattr(hdo, REMAINDERS, None)
    if remainders is not None:
        remainders.current.clear()
        remainders.ahead.clear()


def make_sync_state(accel: object = None):
    """``HybridDeviceOptimizer._sync_hdo_state_to_sub_optimizers`` (megatron copies the state's
    ``master_param`` into its host masters after a load): the masters written back first, read
    from the host on the next step."""
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    original = HybridDeviceOptimizer._sync_hdo_state_to_sub_optimizers

    @functools.wraps(original)
    def sync(self):
        write_back_masters(self)
        result = original(self)
        _host_masters_rewritten(self)
        return result

    return sync


def make_reload_masters(accel: object = None):
    """``HybridDeviceOptimizer.update_fp32_param_by_new_param`` (megatron's ``reload_model_params``
    copies the weights into its host masters): the masters read from the host on the next step."""
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    original = HybridDeviceOptimizer.update_fp32_param_by_new_param

    @functools.wraps(original)
    def reload(self):
        result = original(self)
        _host_masters_rewritten(self)
        return result

    return reload


def make_read_param_state(accel: object = None):
    """``DistributedOptimizer._get_main_param_and_optimizer_states`` (every checkpoint format reads
    a parameter's master and moments through it): the host masters written back first."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._get_main_param_and_optimizer_states

    @functools.wraps(original)
    def read(self, model_param):
        write_back_masters(self.optimizer)
        return original(self, model_param)

    return read


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


def update_on_device(optimizer: Any, moments: torch.dtype = torch.float32, remainders: bool = False) -> int:
    """Marks every ``HybridDeviceOptimizer`` inside megatron's ``optimizer`` (a chained or
    distributed optimizer, or one itself) for the device update, its offloaded Adam moments kept
    in ``moments`` (fp32 or bf16) on the host, and with ``remainders`` its fp32 masters as their
    low halves beside the bf16 weights; returns how many. Raises where the manifest's patches are
    not in place, or for another ``moments``."""
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    from loong_xpu.patches import is_applied

    for target in (TARGET, *(REMAINDER_TARGETS if remainders else ())):
        if not is_applied(target):
            raise RuntimeError(f"loong_xpu.offload_device_update needs the manifest's patch of {target} "
                               "(build and step the optimizer inside loong_xpu.redirect_cuda)")  # fmt: skip
    if moments not in (torch.float32, torch.bfloat16):
        raise ValueError(f"loong_xpu.offload_device_update: moments={moments}; expected torch.float32 or torch.bfloat16")
    found, stack = 0, [optimizer]
    while stack:
        opt = stack.pop()
        if isinstance(opt, HybridDeviceOptimizer):
            setattr(opt, MARK, moments)
            if remainders and getattr(opt, REMAINDERS, None) is None:
                setattr(opt, REMAINDERS, Remainders())
                opt.register_state_dict_pre_hook(write_back_masters)  # its own state_dict holds the masters too
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
