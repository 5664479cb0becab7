"""The one place that decides which implementation each layer uses.

CUDA with Transformer Engine installed: megatron-core's TE layer spec (fused norms + linears,
TE/cuDNN attention). Everywhere else: megatron-core's local modules with :class:`SDPAttention`
as core attention (no materialised attention matrix) and loong-kernels' RMSNorm.
"""

from __future__ import annotations

import dataclasses
import functools

from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from loong_models.attention import SDPAttention
from loong_models.log import logger
from loong_models.norm import RMSNorm

BACKENDS = ("auto", "te", "local")


@functools.cache
def te_installed() -> bool:
    try:
        from megatron.core.extensions.transformer_engine import HAVE_TE
    except Exception:  # TE present but broken (e.g. no CUDA): treat as absent
        return False
    return bool(HAVE_TE)


def resolve_backend(backend: str, device_type: str) -> str:
    """``auto`` -> ``te`` on CUDA when TE imports, else ``local``."""
    if backend not in BACKENDS:
        raise ValueError(f"model.layer_backend={backend!r}; allowed: {', '.join(BACKENDS)}")
    if backend == "auto":
        return "te" if device_type == "cuda" and te_installed() else "local"
    if backend == "te" and not te_installed():
        raise ValueError("model.layer_backend='te' but transformer-engine is not importable "
                         "(install loong-models[te] on a CUDA machine)")
    return backend


def decoder_block_spec(config: TransformerConfig, *, backend: str, vp_stage: int | None = None):
    """Layer specs for the decoder layers of this pipeline stage, plus the final norm.

    ``te``: megatron-core's TE spec as is. ``local``: megatron-core's local modules with
    :class:`SDPAttention` as core attention and Loong's :class:`RMSNorm` for every norm.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    block = get_gpt_decoder_block_spec(
        config, use_transformer_engine=backend == "te", normalization="RMSNorm", vp_stage=vp_stage
    )
    if backend == "te":
        logger.debug("layer spec: transformer-engine")
        return block
    logger.debug("layer spec: local megatron modules + SDPA + loong-kernels RMSNorm")
    return dataclasses.replace(block, layer_specs=[_local_layer(s) for s in block.layer_specs], layer_norm=RMSNorm)


def _local_layer(spec: ModuleSpec) -> ModuleSpec:
    sub = spec.submodules
    attn = sub.self_attention
    attn_sub = attn.submodules
    attn_sub = dataclasses.replace(
        attn_sub,
        core_attention=SDPAttention,
        **{k: RMSNorm for k in ("q_layernorm", "k_layernorm") if getattr(attn_sub, k) is not IdentityOp},
    )
    sub = dataclasses.replace(
        sub,
        self_attention=dataclasses.replace(attn, submodules=attn_sub),
        input_layernorm=RMSNorm,
        pre_mlp_layernorm=RMSNorm,
    )
    return dataclasses.replace(spec, submodules=sub)


def fusion_fields(backend: str) -> dict[str, bool]:
    """TransformerConfig switches for fused kernels that exist only with the TE backend
    (fused RoPE, SwiGLU, bias-dropout-add, wgrad accumulation into main_grad, fused CE)."""
    on = backend == "te"
    return dict(
        apply_rope_fusion=on,
        bias_activation_fusion=on,
        bias_dropout_fusion=on,
        masked_softmax_fusion=False,  # unused: attention is TE's or SDPA
        # megatron fuses wgrad accumulation in its own (non-TE) output layer only through apex,
        # which Loong does not require; TE layers still accumulate into main_grad directly.
        gradient_accumulation_fusion=False,
        cross_entropy_loss_fusion=on,
        **({"cross_entropy_fusion_impl": "te"} if on else {}),
    )
