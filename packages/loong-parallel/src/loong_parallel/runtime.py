"""The TransformerConfig fields the runtime decides: layout, precision, loss normalisation."""

from __future__ import annotations

from typing import Any

import torch

from loong_parallel.config import ParallelConfig

# Options that run on CUDA streams only (megatron's combined 1F1B schedule, async D2H copies).
_CUDA_ONLY = ("moe_a2a_overlap", "moe_shared_expert_overlap", "offload_activations")


def runtime_transformer_fields(
    pcfg: ParallelConfig, *, dtype: torch.dtype, device_type: str
) -> dict[str, Any]:
    for key in _CUDA_ONLY:
        if getattr(pcfg, key) and device_type != "cuda":
            raise ValueError(f"parallel.{key} needs CUDA (device type here: {device_type})")
    if pcfg.cuda_graphs != "none" and device_type != "cuda":
        raise ValueError(
            f"parallel.cuda_graphs={pcfg.cuda_graphs} needs CUDA (device type here: {device_type})"
        )
    if pcfg.moe_a2a_overlap and dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(
            "parallel.moe_a2a_overlap=true needs train.dtype bf16 or fp16 (megatron's requirement)"
        )
    return dict(
        expert_model_parallel_size=pcfg.ep,
        expert_tensor_parallel_size=pcfg.expert_tp,
        moe_token_dispatcher_type=str(pcfg.moe_token_dispatcher),
        moe_shared_expert_overlap=pcfg.moe_shared_expert_overlap,
        overlap_moe_expert_parallel_comm=pcfg.moe_a2a_overlap,
        delay_wgrad_compute=pcfg.moe_delay_wgrad,
        fine_grained_activation_offloading=bool(pcfg.offload_activations),
        offload_modules=[str(m) for m in pcfg.offload_activations],
        tensor_model_parallel_size=pcfg.tp,
        pipeline_model_parallel_size=pcfg.pp,
        context_parallel_size=pcfg.cp,
        cp_comm_type=str(pcfg.cp_comm_type) if pcfg.cp > 1 else None,
        virtual_pipeline_model_parallel_size=pcfg.vpp,
        sequence_parallel=pcfg.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        # On the host, build full weights then shard them: every TP layout starts from the same
        # weights for a seed. On a GPU, initialise shards in place (fast, no host copy).
        use_cpu_initialization=device_type == "cpu",
        # Loss = sum over tokens / tokens in the global batch, whatever the DP or micro-batch split.
        calculate_per_token_loss=True,
        deallocate_pipeline_outputs=True,
        # megatron's per-layer graphs; their RNG must be graph-safe: TE's tracker (seed_everything)
        cuda_graph_impl=str(pcfg.cuda_graphs),
        use_te_rng_tracker=pcfg.cuda_graphs != "none",
    )


def cuda_graph_conflicts(pcfg: ParallelConfig, model: Any, packing: str = "fixed") -> list[str]:
    """Why this job cannot run with ``pcfg.cuda_graphs`` (empty: it can), for a ``model``
    (loong_models.ModelConfig) on data packed by ``packing`` (data.packing): megatron's whole-layer
    graphs replay one captured shape, and a replay needs every non-tensor argument of the layer as
    captured (``_CudaGraphRunner.get_mismatch_errors``); only a language model's layers take
    ``cuda_graph_impl`` (the image encoder's and Wan's TransformerConfigs are their own, pi05 is
    plain torch); megatron's graph toggle switches recomputation off."""
    if pcfg.cuda_graphs == "none":
        return []
    cannot = {
        # the model kind first: what a preset cannot change
        # multimodal data is packed (thd): the layers get each pack's cu_seqlens and host-side segment
        # bounds (HostPackedSeqParams), which megatron compares with the captured ones at replay. (The
        # multimodal RoPE positions, also computed on the host, reach the layers as a tensor: copied.)
        "a model with an image encoder (a VLM's micro-batch is a pack whose segment layout, packed_seq_params, "
        "is set on the host per micro-batch: megatron replays a layer only with the captured one; the image "
        "encoder is not captured)":
            model.is_multimodal,
        "a diffusion model (the DiT's own TransformerConfig does not take cuda_graph_impl: nothing is captured)":
            model.is_diffusion,
        "an embodied model (plain torch layers: nothing is captured; their CUDA graphs are "
        "model.embodied.compile_mode=reduce-overhead)": model.is_embodied,
        "data.packing=thd (a packed step's shapes change with its documents)": packing == "thd",
        "model.foundation.recompute (megatron drops recomputation around its graphs)":
            model.foundation.recompute is not None,
    }  # fmt: skip
    impl = pcfg.cuda_graphs
    return [f"parallel.cuda_graphs={impl} cannot combine with {key}" for key, bad in cannot.items() if bad]


def wgrad_fusion_conflicts(pcfg: ParallelConfig, model: Any) -> list[str]:
    """Why ``parallel.wgrad_fusion=true`` cannot hold for a ``model`` (loong_models.ModelConfig):
    an embodied policy (pi05) is built of plain torch layers, with no megatron or TE linear whose
    weight-gradient GEMM could accumulate into main_grad. (auto leaves it off there.)"""
    if pcfg.wgrad_fusion is True and model.is_embodied:
        return ["parallel.wgrad_fusion=true cannot combine with an embodied model (plain torch layers: no megatron "
                "or TE linears to fuse); use false or null (auto)"]  # fmt: skip
    return []


def fused_qkv_rope_conflicts(pcfg: ParallelConfig, model: Any, packing: str = "fixed") -> list[str]:
    """Why ``model.fused_qkv_rope=true`` cannot run with this job's data and layout (the model's own
    conflicts are loong_models.ModelConfig's): megatron's fused QKV RoPE applies to whole sequences on
    one rank's attention, so no packed documents (``packing``: data.packing), context parallelism or
    ChunkPipe. The first conflict only."""
    if not model.fused_qkv_rope:
        return []
    conflicts = {"data.packing=thd": packing == "thd", f"parallel.cp={pcfg.cp}": pcfg.cp > 1,
                 "parallel.chunkpipe.chunk_size": pcfg.chunkpipe.enabled}  # fmt: skip
    return [f"model.fused_qkv_rope=true cannot be combined with {key}: megatron's fused QKV RoPE applies to "
            "whole sequences (no packed documents, context parallelism or ChunkPipe); set "
            "model.fused_qkv_rope=false" for key, conflict in conflicts.items() if conflict][:1]  # fmt: skip


def output_loss_conflicts(pcfg: ParallelConfig, model: Any) -> list[str]:
    """Why ``model.foundation.output_loss=fused`` (loong_models.foundation.output_loss) cannot run
    with this layout: it computes the whole vocabulary's cross-entropy on one rank from
    whole-sequence hidden states. Pipeline stages (only the last one computes the loss) and context
    parallelism (each rank's tokens, the same averaging) should work by construction, but no test
    compares them with megatron's loss yet, so they are refused too."""
    f = model.foundation
    if model.is_diffusion or model.is_embodied or f.output_loss != "fused":
        return []
    tp = f.tensor_model_parallel_size or pcfg.tp
    cannot = {
        f"parallel.tp={tp} (the output layer's vocabulary is split across ranks)": tp > 1,
        "parallel.sequence_parallel=true": pcfg.sequence_parallel,
        "parallel.chunkpipe (it computes each chunk's loss itself)": pcfg.chunkpipe.enabled,
        f"parallel.pp={pcfg.pp} (not yet tested against megatron's loss)": pcfg.pp > 1,
        f"parallel.cp={pcfg.cp} (not yet tested against megatron's loss)": pcfg.cp > 1,
    }
    return [f"model.foundation.output_loss=fused cannot combine with {what}; use output_loss=megatron"
            for what, present in cannot.items() if present]  # fmt: skip
