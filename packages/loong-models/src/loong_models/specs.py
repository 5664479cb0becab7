"""The one place that decides which implementation each layer uses.

CUDA with Transformer Engine installed: megatron-core's TE layer spec (fused norms + linears,
TE/cuDNN attention). Everywhere else: megatron-core's local modules with :class:`SDPAttention`
as core attention (no materialised attention matrix).
"""

from __future__ import annotations

import dataclasses
import functools

from megatron.core.transformer.spec_utils import ModuleSpec

from loong_models.attention import SDPAttention
from loong_models.log import logger

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


def transformer_layer_spec(*, qk_norm: bool, backend: str) -> ModuleSpec:
    """Layer spec for a dense pre-norm decoder layer (RMSNorm, SwiGLU), for ``backend``."""
    from megatron.core.models.gpt import gpt_layer_specs

    if backend == "te":
        logger.debug("layer spec: transformer-engine")
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_norm)
    logger.debug("layer spec: local megatron modules + SDPA")
    spec = gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=qk_norm, normalization="RMSNorm")
    attn = spec.submodules.self_attention
    attn_sub = dataclasses.replace(attn.submodules, core_attention=SDPAttention)
    attn = dataclasses.replace(attn, submodules=attn_sub)
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attn))


def fusion_fields(backend: str) -> dict[str, bool]:
    """TransformerConfig switches for fused kernels that exist only with the TE backend
    (fused RoPE, SwiGLU, bias-dropout-add, wgrad accumulation into main_grad, fused CE)."""
    on = backend == "te"
    return dict(
        apply_rope_fusion=on,
        bias_activation_fusion=on,
        bias_dropout_fusion=on,
        masked_softmax_fusion=False,  # unused: attention is TE's or SDPA
        gradient_accumulation_fusion=on,
        cross_entropy_loss_fusion=on,
        **({"cross_entropy_fusion_impl": "te"} if on else {}),
    )
