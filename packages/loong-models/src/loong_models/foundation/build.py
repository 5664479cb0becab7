"""FoundationConfig -> megatron-core TransformerConfig -> GPTModel.

megatron-core 0.19 flags GPTModel as deprecated in favour of HybridModel, but HybridModel has no
Llama-3 RoPE scaling and no multimodal RoPE (needed by Qwen2.5-VL), so the foundation is built on
GPTModel. This module is the only place that chooses the model class: megatron's GPTModel, or
its subclass :class:`~loong_models.foundation.output_loss.FusedLossGPTModel` for
``output_loss: fused``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from loong_models.foundation.config import FoundationConfig
from loong_models.foundation.families import get_family
from loong_models.foundation.mrope import InterleavedMultimodalRotaryEmbedding
from loong_models.foundation.output_loss import FusedLossGPTModel, OutputLoss
from loong_models.log import logger
from loong_models.specs import decoder_block_spec, mtp_block_spec


def build_transformer_config(cfg: FoundationConfig, **runtime: Any) -> TransformerConfig:
    """The architecture from ``cfg``; ``runtime`` adds what the parallel runtime decides
    (``tensor_model_parallel_size``, ``pipeline_model_parallel_size``, ``params_dtype``, ``bf16``,
    fusions, recompute ...), as megatron ``TransformerConfig`` fields."""
    cfg.validate()
    fam = get_family(cfg.family)
    arch = dict(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.query_groups,
        kv_channels=cfg.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=fam.qkv_bias,
        qk_layernorm=fam.qk_norm,
        init_method_std=cfg.init_method_std,
        embedding_init_method_std=cfg.embedding_init_std,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    if cfg.recompute is not None:
        arch.update(recompute_granularity=cfg.recompute)
        if cfg.recompute == "full":
            arch.update(recompute_method="uniform", recompute_num_layers=1)
        if cfg.recompute_modules is not None:
            arch.update(recompute_modules=list(cfg.recompute_modules))
    if cfg.moe is not None:
        arch.update(moe_fields(cfg))
    if cfg.mtp_num_layers is not None:
        arch.update(mtp_num_layers=cfg.mtp_num_layers, mtp_loss_scaling_factor=cfg.mtp_loss_scaling_factor)
    if "moe_act" in (cfg.recompute_modules or []) and not runtime.get("moe_grouped_gemm"):
        # megatron recomputes the expert activation only inside its grouped-GEMM experts
        raise ValueError(
            "model.foundation.recompute_modules: 'moe_act' needs grouped-GEMM experts (model.layer_backend=te); "
            "on the local backend use 'moe'"
        )
    if cfg.mla is None:
        fields = {**arch, **cfg.extra, **runtime}
        if cfg.mrope_section is not None:
            # TE's fused THD RoPE restarts positions per segment; multimodal positions are per token
            fields.update(mrope_section=list(cfg.mrope_section), apply_rope_fusion=False)
        return TransformerConfig(**fields)
    return _mla_transformer_config(cfg, {**arch, **cfg.extra, **runtime})


def moe_fields(cfg: FoundationConfig) -> dict[str, Any]:
    """The ``moe:`` sub-config under megatron's ``moe_*`` names."""
    moe = cfg.moe
    assert moe is not None
    return dict(
        num_moe_experts=moe.num_experts,
        moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_router_topk=moe.router_topk,
        moe_layer_freq=moe.layer_pattern(cfg.num_layers),
        moe_shared_expert_intermediate_size=moe.shared_expert_intermediate_size,
        moe_router_score_function=moe.score_function,
        # top-k over the raw scores, then normalised over the chosen k (HF's norm_topk_prob=True)
        moe_router_pre_softmax=False,
        moe_router_topk_scaling_factor=moe.topk_scaling_factor,
        moe_router_num_groups=moe.num_groups,
        moe_router_group_topk=moe.group_topk,
        moe_router_enable_expert_bias=moe.expert_bias,
        moe_router_bias_update_rate=moe.bias_update_rate,
        moe_router_load_balancing_type=moe.load_balancing,
        moe_aux_loss_coeff=moe.aux_loss_coeff,
        moe_z_loss_coeff=moe.z_loss_coeff,
        moe_expert_capacity_factor=moe.capacity_factor,
        moe_pad_expert_input_to_capacity=moe.pad_to_capacity,
        moe_token_drop_policy=moe.token_drop_policy,
        moe_router_dtype=moe.router_dtype,
    )


def _mla_transformer_config(cfg: FoundationConfig, fields: dict[str, Any]) -> MLATransformerConfig:
    """MLA (+ DSA) fields under megatron's own names (``MLATransformerConfig``, ``dsa_indexer_*``)."""
    mla, dsa = cfg.mla, cfg.sparse_attention
    assert mla is not None
    fields.update(
        q_lora_rank=mla.q_lora_rank,
        kv_lora_rank=mla.kv_lora_rank,
        qk_head_dim=mla.qk_head_dim,
        qk_pos_emb_head_dim=mla.qk_pos_emb_head_dim,
        v_head_dim=mla.v_head_dim,
        qk_layernorm=True,  # in MLA: RMSNorm on the query and KV latents (DeepSeek's q_a/kv_a norms)
        rotary_base=cfg.rotary_base,
        # megatron fuses MLA RoPE for YaRN only, and its DSA rejects the fusion; Loong's RoPE is plain
        apply_rope_fusion=False,
    )
    if dsa is not None:
        # Megatron's names for these sizes. `experimental_attention_variant` stays unset: that
        # switch selects megatron's own DSA modules and spec, while Loong's spec (specs.py)
        # builds the layers around Loong's DSAttention.
        fields.update(
            dsa_indexer_n_heads=dsa.index_n_heads,
            dsa_indexer_head_dim=dsa.index_head_dim,
            dsa_indexer_topk=dsa.index_topk,
            dsa_indexer_loss_coeff=dsa.indexer_loss_coeff,
        )
    rs = cfg.rope_scaling
    if rs is None:
        fields.update(rope_type="rope")
    else:  # YaRN (validated: the only scaling of MLA families), under megatron's names
        fields.update(rope_type="yarn", rotary_scaling_factor=rs.factor, beta_fast=rs.beta_fast,
                      beta_slow=rs.beta_slow, mscale=rs.mscale, mscale_all_dim=rs.mscale_all_dim,
                      original_max_position_embeddings=rs.original_max_position_embeddings)  # fmt: skip
    config = MLATransformerConfig(**fields)
    if dsa is not None:
        # megatron's pipeline schedules call this hook after each micro-batch's loss with the
        # main loss's backward scale (1/num_microbatches unless calculate_per_token_loss), so the
        # indexer loss attached by DSAIndexerLossAutoScaler is scaled like the LM loss.
        from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossAutoScaler

        config.experimental_attention_variant_loss_scale_func = DSAIndexerLossAutoScaler.set_loss_scale
    return config


def build_foundation(
    cfg: FoundationConfig,
    config: TransformerConfig,
    *,
    layer_backend: str,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: int | None = None,
    scatter_embedding_sequence_parallel: bool = True,
    deepstack: bool = False,
) -> GPTModel:
    """One pipeline stage (``pre_process``: has the embedding; ``post_process``: has the head).
    ``scatter_embedding_sequence_parallel=False``: the embedding leaves the sequence whole under
    sequence parallelism (a VLM writes image features into it first, then scatters).
    ``deepstack``: layers that add DeepStack vision features (foundation/deepstack.py)."""
    rs = cfg.rope_scaling
    spec = decoder_block_spec(config, backend=layer_backend, vp_stage=vp_stage, deepstack=deepstack)
    fused_loss = cfg.output_loss == OutputLoss.fused
    head = {"fp8_output_layer": cfg.precision.fp8_output_layer, "chunk_tokens": cfg.output_loss_chunk_tokens} if fused_loss else {}
    if head.get("fp8_output_layer") and post_process:
        logger.info("model.foundation.precision.fp8_output_layer: the output layer's GEMMs run in FP8 "
                    "(loong_kernels' FP8 fused loss: tensorwise E4M3, E5M2 gradients)")  # fmt: skip
    model = (FusedLossGPTModel if fused_loss else GPTModel)(
        config=config,
        transformer_layer_spec=spec,
        mtp_block_spec=mtp_block_spec(config, spec, backend=layer_backend, vp_stage=vp_stage),
        vocab_size=cfg.padded_vocab_size(config.tensor_model_parallel_size),
        max_sequence_length=cfg.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=cfg.tie_word_embeddings,
        position_embedding_type="rope" if cfg.mrope_section is None else "mrope",
        scatter_embedding_sequence_parallel=scatter_embedding_sequence_parallel,
        rotary_base=int(cfg.rotary_base),
        rope_scaling=rs is not None and rs.type == "llama3",  # MLA's YaRN lives in its attention
        rope_scaling_factor=rs.factor if rs is not None else 8.0,
        vp_stage=vp_stage,
        **head,
    )
    if cfg.mrope_interleaved:  # Qwen3-VL's frequency layout (megatron knows the block layout only)
        old = model.rotary_pos_emb
        model.rotary_pos_emb = InterleavedMultimodalRotaryEmbedding(
            kv_channels=config.kv_channels, rotary_percent=1.0, rotary_interleaved=config.rotary_interleaved,
            seq_len_interpolation_factor=old.seq_len_interpolation_factor, rotary_base=int(cfg.rotary_base),
            cp_group=old.cp_group,
        )  # fmt: skip
    if cfg.mrope_section is not None:
        # the VLM hands its foundation each context-parallel rank's own positions (cut with its
        # tokens, OmniCombinationModel.positions): megatron's module must not cut them again
        model.rotary_pos_emb.cp_group = None
    if cfg.freeze:
        for p in model.parameters():
            p.requires_grad_(False)
    return model


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
