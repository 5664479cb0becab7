"""megatron's scaling of its gradient buffers in one vectorised multi-tensor pass.

With per-token losses (``calculate_per_token_loss``, how Loong trains) megatron's
``finalize_model_grads`` divides every gradient by the step's token count, a 0-dim device tensor,
through ``_ParamAndGradBuffer.scale_gradients``: ``grad_data *= scaling_factor``. To TensorIterator
a 0-dim device tensor is a stride-0 operand, and its kernel for that case does not vectorise: on
an H100 the 2.47 GB bf16 buffer of llama3.2-1b took 5.5 ms a step (two launches: the buffer
exceeds 32-bit indexing), about three times a copy of it, 0.7% of the step at micro-batch 12.

``torch._foreach_mul_`` with a tensor scalar reads the scalar from device memory in the
vectorised multi-tensor kernel. The products are the same: TensorIterator rounds the scalar to
the buffer's dtype (the common dtype) before multiplying, and so does :func:`scale_gradients`.
A host-side scalar (a float, or a CPU tensor, which TensorIterator reads at full precision) keeps
megatron's own in-place multiply.
"""

from __future__ import annotations

import torch

TARGET = "megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBuffer.scale_gradients"


def make_scale_gradients(accel: object = None):
    """The method the manifest puts in place of megatron's ``scale_gradients``."""
    return scale_gradients


@torch.no_grad()
def scale_gradients(self, scaling_factor: float | torch.Tensor) -> None:
    """Scale the buffer's gradients (``grad_data`` and ``extra_main_grads``) by ``scaling_factor``."""
    grads = [self.grad_data, *self.extra_main_grads]
    if not isinstance(scaling_factor, torch.Tensor) or scaling_factor.device.type == "cpu":
        for grad in grads:
            grad.mul_(scaling_factor)
        return
    scale_by_device_scalar_(grads, scaling_factor)


def scale_by_device_scalar_(tensors: list[torch.Tensor], scale: torch.Tensor) -> None:
    """``t.mul_(scale.to(t.dtype))`` for every tensor, one multi-tensor launch per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for dtype, group in by_dtype.items():
        torch._foreach_mul_(group, scale.to(dtype))
