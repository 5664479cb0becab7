"""Build this rank's model chunks and wrap them in megatron-core's DDP."""

from __future__ import annotations

from collections.abc import Callable

import torch
from megatron.core import parallel_state as mpu
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.tensor_parallel import layers as mlayers
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.transformer_config import TransformerConfig

from loong_models.specs import te_installed
from loong_parallel.config import GradAccumulation, ParallelConfig
from loong_parallel.grad_accumulation import batch_grad_accumulation
from loong_parallel.log import logger
from loong_xpu import Accelerator

# provider(pre_process, post_process, vp_stage) -> one pipeline stage of the model
ModelProvider = Callable[[bool, bool, int | None], torch.nn.Module]


def build_model_chunks(
    provider: ModelProvider,
    pcfg: ParallelConfig,
    config: TransformerConfig,
    accel: Accelerator,
) -> list[DistributedDataParallel]:
    """One chunk per virtual pipeline stage (one in all without interleaving), on the device,
    wrapped in DDP. Also installs the gradient hooks megatron's schedules call into ``config``."""
    if _stages_in_order(pcfg, config):
        chunks = [_build_as_one_process(provider, pcfg.pp, config).to(accel.device())]
    else:
        chunks = []
        for vp in range(pcfg.vpp or 1):
            vp_stage = vp if pcfg.vpp else None
            pre = mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
            post = mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
            chunks.append(provider(pre, post, vp_stage).to(accel.device()))
    for chunk in chunks:  # collective setup a model defers until every rank has built its stage
        finish = getattr(unwrap(chunk), "finish_build", None)  # (the decoupled encoder layout)
        if finish is not None:
            finish()
    if wgrad_fusion_on(pcfg, accel):
        for chunk in chunks:
            fuse_wgrad_accumulation(chunk, required=pcfg.wgrad_fusion is True)
    ddp_config = ddp_config_for(pcfg)
    wrapped = [
        # Only the first chunk buckets: megatron's recipe, so that later chunks' reductions
        # do not wait on buckets of chunks whose backward has not run yet.
        DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=i > 0)
        for i, chunk in enumerate(chunks)
    ]
    if pcfg.grad_accumulation == GradAccumulation.batched:
        for chunk in wrapped:
            batch_grad_accumulation(chunk)
    config.finalize_model_grads_func = finalize_model_grads
    if pcfg.overlap_grad_reduce:
        no_sync = [c.no_sync for c in wrapped]
        config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
        grad_sync = [c.start_grad_sync for c in wrapped]
        config.grad_sync_func = grad_sync[0] if len(grad_sync) == 1 else grad_sync
    if pcfg.overlap_param_gather:
        param_sync = [c.start_param_sync for c in wrapped]
        config.param_sync_func = param_sync[0] if len(param_sync) == 1 else param_sync
    return wrapped


def ddp_config_for(pcfg: ParallelConfig) -> DistributedDataParallelConfig:
    """megatron's DDP settings for this parallel layout."""
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=pcfg.grad_reduce_in_fp32,
        overlap_grad_reduce=pcfg.overlap_grad_reduce,
        overlap_param_gather=pcfg.overlap_param_gather,
        use_distributed_optimizer=pcfg.distributed_optimizer,
        bucket_size=pcfg.ddp_bucket_size,
        # With delayed weight gradients, TE's backward leaves a linear's weight gradient for
        # backward_dw (None, or an unwritten buffer for grouped experts without the wgrad fusion)
        # and marks the weight skip_backward_post_hook. Only with this flag does DDP hook those
        # modules' backward_dw instead of the weights' AccumulateGrad nodes; without it the
        # AccumulateGrad hook adds that buffer into main_grad (the non-finite gradients at
        # Qwen3-30B-A3B EP=4) and the gradients backward_dw computes are never added.
        delay_wgrad_compute=pcfg.moe_delay_wgrad,
    )


def wgrad_fusion_on(pcfg: ParallelConfig, accel: Accelerator) -> bool:
    """``parallel.wgrad_fusion``: true / false, or null (auto): on where TE runs (CUDA with
    Transformer Engine installed), where the fused GEMM saves the separate fp32 add per
    micro-batch; elsewhere the accumulation is torch's upcast addmm_, no faster than the add."""
    if pcfg.wgrad_fusion is None:
        return accel.supports("te") and te_installed()
    return pcfg.wgrad_fusion


def fuse_wgrad_accumulation(model: torch.nn.Module, required: bool = True) -> int:
    """Switch the model's linears to accumulate their weight gradients straight into DDP's
    ``main_grad`` (parallel.wgrad_fusion): TE's linears through TE's own fused accumulation,
    megatron's own linears (the output layer; all of them on the local backend) through
    ``gradient_accumulation_fusion`` with loong_xpu's GEMMs in place of apex's (the patch manifest).
    The switch is per module, after the build and before DDP allocates ``main_grad`` (which a
    switched linear needs in backward): megatron's config flag would refuse without apex, and a
    model built outside :func:`build_model_chunks` (no DDP) keeps the plain path. A weight whose grad does
    not go through a fused GEMM (an embedding, one tied to the output layer) keeps DDP's add.
    Returns the number of modules switched; ``required``: none to switch is an error."""
    te, local = 0, 0
    for module in model.modules():
        if hasattr(module, "fuse_wgrad_accumulation") and hasattr(module, "will_execute_quantized"):
            module.fuse_wgrad_accumulation = True
            te += 1
        elif isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            module.gradient_accumulation_fusion = True
            local += 1
    if local and not hasattr(mlayers, "fused_weight_gradient_mlp_cuda"):
        raise RuntimeError("parallel.wgrad_fusion: megatron's own linears need loong_xpu's wgrad GEMMs; "
                           "build the model inside loong_xpu.redirect_cuda (it supplies them on every backend)")  # fmt: skip
    logger.info("parallel.wgrad_fusion: %d TE and %d megatron linears accumulate wgrad into main_grad", te, local)
    if required and not te + local:
        raise ValueError("parallel.wgrad_fusion=true but the model has no megatron or TE linears to fuse; "
                         "set parallel.wgrad_fusion=false (or null: auto)")  # fmt: skip
    return te + local


def _stages_in_order(pcfg: ParallelConfig, config: TransformerConfig) -> bool:
    """Host initialisation draws every weight from the one host RNG stream (the same on every
    rank), so a pipeline stage gets one process's weights only if the stages before it drew
    theirs first. Not with virtual stages (interleaved layers), nor for device initialisation
    (megatron's model-parallel RNG streams)."""
    return pcfg.pp > 1 and not pcfg.vpp and config.use_cpu_initialization


def _build_as_one_process(provider: ModelProvider, pp: int, config: TransformerConfig) -> torch.nn.Module:
    """This rank's stage, built after the stages before it are built and dropped, so that the host
    RNG stream runs as in one process: embedding, layer 1..L, output layer. Stages hold
    equal layer counts of one shape, so another stage's draws are this rank's layers' (built with
    its own layer offset) plus the embedding / output layer where ``pre`` / ``post`` say so.
    Costs transient host copies of the model; only used with host initialisation.

    With tied embeddings megatron all-reduces the shared weight between the first and the last
    stage while building them (the last stage's copy starts at zero): only the rank's own stage
    may take part, so the others are built with ``init_model_with_meta_device`` set, the flag
    that skips that reduction (it changes nothing else on the host path)."""
    rank, own = mpu.get_pipeline_model_parallel_rank(), None
    skip_sync = config.init_model_with_meta_device
    for stage in range(rank + 1):
        config.init_model_with_meta_device = skip_sync or stage != rank
        try:
            module = provider(stage == 0, stage == pp - 1, None)
        finally:
            config.init_model_with_meta_device = skip_sync
        if stage == rank:
            own = module
        del module
    return own


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The model inside DDP (and any other ``.module`` wrapper)."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk
