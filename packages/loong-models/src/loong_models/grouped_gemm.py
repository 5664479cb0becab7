"""``model.grouped_gemm_kernel=cublaslt``: TE's cuBLASLt grouped GEMM for the MoE experts.

TE's default runs one cuBLAS GEMM per local expert, and its CUTLASS grouped kernel
(``cutlass``) covers only the GEMMs whose K all experts share: the forward and data gradients.
The weight gradients, whose K is each expert's token count, stay one launch per expert. TE's
grouped-tensor path runs all three as one cuBLASLt grouped GEMM each, with the split sizes read
on the device (``GroupedLinear.use_grouped_tensor``; Hopper needs cuBLASLt 13.4 or newer).

That path takes the split sizes only as a CUDA tensor, while megatron's ``TEGroupedMLP`` hands its
linears a host list (it needs the counts on the host for its own padding). A forward pre-hook on
each grouped linear copies the list to the device, from pinned memory without blocking the host,
so neither megatron nor TE is patched.
"""

from __future__ import annotations

import torch
from torch.utils.hooks import RemovableHandle

from loong_models.log import logger


def splits_on_device(module: torch.nn.Module, args: tuple) -> tuple | None:
    """Forward pre-hook of a grouped linear called as ``(x, m_splits, ...)``: a host list of split
    sizes becomes an int64 tensor on ``x``'s device (queued from pinned memory on CUDA)."""
    if len(args) < 2 or isinstance(args[1], torch.Tensor):
        return None
    x, splits, *rest = args
    host = torch.tensor(list(splits), dtype=torch.int64, pin_memory=x.is_cuda)
    return (x, host.to(x.device, non_blocking=True), *rest)


def cublaslt_grouped_gemm_supported(dtype: torch.dtype) -> tuple[bool, str]:
    """Whether TE's grouped-tensor GEMM runs here for ``dtype`` activations, and what was found."""
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.module.grouped_linear import is_module_grouped_tensor_path_supported

    major, minor = torch.cuda.get_device_capability()
    found = f"cuBLASLt {tex.get_cublasLt_version()}, sm_{major}{minor}, {dtype}"
    return is_module_grouped_tensor_path_supported(None, dtype), found


def use_cublaslt_grouped_gemms(model: torch.nn.Module, dtype: torch.dtype) -> list[RemovableHandle]:
    """Switch every TE ``GroupedLinear`` of ``model`` to TE's cuBLASLt grouped GEMM; returns the
    pre-hooks' handles (removing them and resetting ``use_grouped_tensor`` switches back).

    Raises ``ValueError`` naming the key when the GPU, cuBLASLt or ``dtype`` cannot run it, or
    when the model has no grouped linears (it would silently change nothing)."""
    from transformer_engine.pytorch import GroupedLinear

    ok, found = cublaslt_grouped_gemm_supported(dtype)
    if not ok:
        raise ValueError(f"model.grouped_gemm_kernel=cublaslt: TE's cuBLASLt grouped GEMM does not run here ({found}); "
                         "it needs Hopper with cuBLASLt >= 13.4 or Blackwell with >= 13.3, BF16/FP16: "
                         "use cutlass or cublas")  # fmt: skip
    linears = [m for m in model.modules() if isinstance(m, GroupedLinear)]
    if not linears:
        raise ValueError("model.grouped_gemm_kernel=cublaslt: the model has no TE grouped linears "
                         "(its experts are not TE's TEGroupedMLP)")  # fmt: skip
    handles = []
    for linear in linears:
        linear.use_grouped_tensor = True  # read by TE on every forward
        handles.append(linear.register_forward_pre_hook(splits_on_device))
    logger.info("MoE experts' grouped GEMMs: cublaslt on %d grouped linears (%s)", len(linears), found)
    return handles
