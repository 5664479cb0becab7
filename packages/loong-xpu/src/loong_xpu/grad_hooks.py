"""megatron's DDP without its per-parameter gradient-accumulation hooks (Loong's
``parallel.grad_accumulation=batched``).

megatron-core's ``DistributedDataParallel`` registers, for every parameter, a Python hook on the
parameter's AccumulateGrad node that adds ``param.grad`` into ``param.main_grad`` (unless a fused
GEMM already did: ``grad_added_to_main_grad``) and drops ``param.grad``: one hook call and one add
launch per parameter and micro-batch (805 of each per step for the full-shape Pi0.5, ~22 ms of
host time in a host-bound step). It offers no option to do without them.

DDP keeps the only references to the hooked nodes in its ``grad_accs`` list (a parameter holds its
node weakly), so clearing that list makes autograd build hook-free nodes from the next forward on:
the gradients then stay in ``param.grad`` (no copy: autograd takes the tensor the backward
produced) and :func:`flush_grads` adds all of them into ``main_grad`` with one multi-tensor add,
the hook's own adds in one launch: the sums and their rounding are the hooks'.

The patch manifest (:data:`loong_xpu.patches.MANIFEST`) adds
:func:`drop_grad_accumulation_hooks` to ``DistributedDataParallel`` as the method named by
:data:`METHOD`; it checks that megatron still keeps one hooked node per parameter in
``grad_accs`` and fails naming the patch otherwise.
"""

from __future__ import annotations

import torch

METHOD = "loong_drop_grad_accumulation_hooks"
TARGET = f"megatron.core.distributed.distributed_data_parallel:DistributedDataParallel.{METHOD}"
# the DDP-chunk attribute marking dropped hooks: its parameters that take gradients
PARAMS_ATTR = "loong_batched_grad_params"


def make_drop_grad_accumulation_hooks(accel: object = None):
    """The method the manifest adds to megatron's ``DistributedDataParallel``."""
    return drop_grad_accumulation_hooks


def drop_grad_accumulation_hooks(self) -> None:
    """Drop this DDP chunk's per-parameter accumulation hooks: from the next forward on, gradients
    wait in ``param.grad`` until :func:`flush_grads`."""
    params = [p for p in self.module.parameters() if p.requires_grad]
    grad_accs = getattr(self, "grad_accs", None)
    nodes = grad_accs if isinstance(grad_accs, list) else []
    # megatron 0.19 hooks every such parameter's AccumulateGrad node and keeps it in grad_accs,
    # except with delay_wgrad_compute / GTP weight remat, which hook modules instead
    if len(nodes) != len(params) or any(type(n).__name__ != "AccumulateGrad" for n in nodes):
        found = "no grad_accs list" if grad_accs is None else f"{len(nodes)} entries for {len(params)} parameters"
        raise RuntimeError(f"loong_xpu patch {TARGET}: megatron-core's DistributedDataParallel no longer keeps one "
                           f"hooked AccumulateGrad node per parameter in grad_accs ({found}); "
                           "parallel.grad_accumulation=batched cannot drop its hooks (use hooks)")  # fmt: skip
    nodes.clear()
    setattr(self, PARAMS_ATTR, params)


@torch.no_grad()
def flush_grads(chunks: list[torch.nn.Module]) -> None:
    """Add every pending ``param.grad`` of ``chunks`` whose hooks were dropped into its
    ``main_grad`` (one multi-tensor add) and drop it, as megatron's hook would have one by one;
    weights whose GEMM already accumulated into ``main_grad`` (``grad_added_to_main_grad``, the
    wgrad fusion) only drop theirs."""
    mains, grads = [], []
    for chunk in chunks:
        for p in getattr(chunk, PARAMS_ATTR, ()):
            # (megatron's fp32 optimizer points .grad at main_grad for its step)
            if p.grad is None or p.grad is p.main_grad:
                continue
            if not getattr(p, "grad_added_to_main_grad", False):
                mains.append(p.main_grad)
                grads.append(p.grad)
            p.grad = None
    if grads:
        torch._foreach_add_(mains, grads)
