"""megatron's optimizer step that leaves the weights alone when the gradient norm is NaN / Inf.

megatron-core's ``ChainedOptimizer.step`` (what ``get_megatron_optimizer`` builds) computes the
global gradient norm (``get_grad_norm``, all-reduced: the same on every rank), clips by it and
updates (``step_with_ready_grads``). A NaN / Inf gradient makes that norm non-finite, yet megatron
steps anyway: its ``grad_norm_skip_threshold`` compares with ``>``, false for NaN, and clipping by
a NaN norm leaves the gradients as they are. There is no option that skips such a step, and
checking the gradients before the step would cost a second pass over them and a host sync.

The patch manifest wraps both methods (:func:`make_get_grad_norm`, :func:`make_step_with_ready_grads`).
They behave as megatron's unless :func:`step_unless_nonfinite` armed the optimizer for one step:
then the norm is read on the host as it is computed (before the update is queued), together with
the caller's own device values (``watch``: the step's loss, so one host read serves both), and the
update runs only if all of them are finite. A megatron whose step stops going through either
method fails naming the patch.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

OWNER = "megatron.core.optimizer.optimizer:ChainedOptimizer"
GET_NORM = f"{OWNER}.get_grad_norm"
UPDATE = f"{OWNER}.step_with_ready_grads"
_ARMED = "_loong_nonfinite_step"  # the optimizer attribute holding one armed step's record
_OURS = "_loong_nonfinite_wrapper"  # marks the two wrappers: whether the manifest put them in place


@dataclass
class _Step:
    watch: object = None  # a device tensor read with the norm (step_unless_nonfinite's ``watch``)
    norms: list[float] = field(default_factory=list)  # gradient norms the step computed, read on the host
    watched: list[float] | None = None  # ``watch``'s values, read with the norm
    updates: int = 0  # times the step reached step_with_ready_grads

    def read(self, norm) -> None:
        """The norm (a float, or megatron's device tensor) and ``watch`` in one host read."""
        import torch

        if self.watch is None:
            self.norms.append(float(norm))
            return
        watch = self.watch.detach().double().reshape(-1)
        if isinstance(norm, torch.Tensor) and norm.device == watch.device:
            values = torch.cat([norm.detach().double().reshape(1), watch]).tolist()
        else:
            values = [float(norm), *watch.tolist()]
        self.norms.append(values[0])
        self.watched = values[1:]

    def finite(self) -> bool:
        return all(math.isfinite(v) for v in [*self.norms, *(self.watched or [])])


def make_get_grad_norm(accel: object = None):
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    original = ChainedOptimizer.get_grad_norm

    @functools.wraps(original)
    def get_grad_norm(self):
        norm = original(self)
        armed = self.__dict__.get(_ARMED)
        if armed is not None:  # megatron 0.19: a device tensor with TE's multi-tensor kernels, else a float
            armed.read(norm)
        return norm

    setattr(get_grad_norm, _OURS, True)
    return get_grad_norm


def make_step_with_ready_grads(accel: object = None):
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    original = ChainedOptimizer.step_with_ready_grads

    @functools.wraps(original)
    def step_with_ready_grads(self) -> bool:
        armed = self.__dict__.get(_ARMED)
        if armed is None:
            return original(self)
        armed.updates += 1
        if len(armed.norms) != 1:
            raise RuntimeError(f"loong_xpu patch {GET_NORM}: megatron's ChainedOptimizer.step computed "
                               f"{len(armed.norms)} gradient norms before its update, expected one (megatron-core changed)")  # fmt: skip
        return original(self) if armed.finite() else False

    setattr(step_with_ready_grads, _OURS, True)
    return step_with_ready_grads


def step_unless_nonfinite(optimizer, watch=None) -> tuple[bool, float | None, list[float] | None]:
    """One ``optimizer.step()`` of a megatron ``ChainedOptimizer`` whose update runs only if the
    gradient norm it computes, and every value of the device tensor ``watch`` (e.g. the step's
    loss), are finite. Returns (updated, the norm as a float, ``watch``'s values): both read in one
    host read before the update was queued, so reading them costs no wait for the update and no
    second sync. The norm is None where megatron's loss scaler found an overflow and returned
    before computing it; ``watch`` is then read after the step (None without ``watch``)."""
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    missing = [t for t in (GET_NORM, UPDATE) if not getattr(getattr(ChainedOptimizer, t.rsplit(".", 1)[1]), _OURS, False)]
    if missing:
        raise RuntimeError(f"the non-finite step skip needs loong_xpu's patch {missing[0]}: "
                           "run the step inside loong_xpu.redirect_cuda")  # fmt: skip
    armed = optimizer.__dict__[_ARMED] = _Step(watch=watch)
    try:
        ok, _, _ = optimizer.step()
    finally:
        del optimizer.__dict__[_ARMED]
    if len(armed.norms) > 1 or (ok and not armed.norms):
        raise RuntimeError(f"loong_xpu patch {GET_NORM}: megatron's ChainedOptimizer.step computed "
                           f"{len(armed.norms)} gradient norms through get_grad_norm, expected one (megatron-core changed)")  # fmt: skip
    if ok and not armed.updates:
        raise RuntimeError(f"loong_xpu patch {UPDATE}: megatron's ChainedOptimizer.step updated without calling "
                           "step_with_ready_grads (megatron-core changed): a non-finite step would not be skipped")  # fmt: skip
    if watch is not None and armed.watched is None:
        armed.watched = watch.detach().double().reshape(-1).tolist()
    return ok, armed.norms[0] if armed.norms else None, armed.watched
