"""The one place that decides which implementation each layer uses.

CUDA with Transformer Engine installed: megatron-core's TE layer spec (fused norms + linears,
TE/cuDNN attention). Everywhere else: megatron-core's local modules with :class:`SDPAttention`
as core attention (no materialised attention matrix) and loong-kernels' RMSNorm.

Mixture-of-Experts layers (``num_moe_experts`` set) keep megatron's MoE spec of the backend:
TE's grouped-GEMM experts (``TEGroupedMLP``, ``moe_grouped_gemm`` from :func:`fusion_fields`)
with TE, megatron's ``SequentialMLP`` locally; router, shared experts and token dispatcher are
megatron's. MLA without sparse attention (DeepSeek-V3) is megatron's ``MLASelfAttention``; on
the local backend with :class:`SDPAttention` and Loong's RMSNorm for its latent norms.

DeepSeek sparse attention (MLA config with ``dsa_indexer_topk`` set), on either backend:
megatron's ``AbsorbedMLASelfAttention`` (the backend's linears) with Loong's
:class:`DSAttention` as core attention (loong-kernels: TileLang on CUDA, torch elsewhere) and
Loong's RMSNorm for the layer-input and latent norms; the MLP stays the backend's.
"""

from __future__ import annotations

import dataclasses
import functools
from enum import StrEnum

from megatron.core.models.backends import BackendSpecProvider
from megatron.core.models.backends import LocalSpecProvider as MegatronLocalSpecProvider
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from loong_models.attention import DSAttention, DSAttentionSubmodules, LightningIndexer, SDPAttention
from loong_models.log import logger
from loong_models.norm import RMSNorm


class LayerBackend(StrEnum):
    """Which layer implementations a model uses (``model.layer_backend``)."""

    auto = "auto"  # te on CUDA when transformer-engine imports, else local
    te = "te"  # megatron-core's transformer-engine spec
    local = "local"  # megatron-core's local modules, SDPA attention, Loong's RMSNorm


class AttentionBackend(StrEnum):
    """TE's attention kernel (``model.attention_backend``; megatron's attention_backend, which sets
    TE's NVTE_*_ATTN switches). Only with TE layers."""

    auto = "auto"  # TE picks per shape
    flash = "flash"  # FlashAttention (TE's flash-attn backend; needs the flash-attn package)
    fused = "fused"  # cuDNN fused attention
    unfused = "unfused"  # TE's plain softmax(QK^T)V


def attention_backend_fields(choice: AttentionBackend | str) -> dict:
    """The TransformerConfig field for a non-default choice (none for auto)."""
    if choice == AttentionBackend.auto:
        return {}
    from megatron.core.transformer.enums import AttnBackend

    return {"attention_backend": AttnBackend[str(choice)]}


@functools.cache
def te_installed() -> bool:
    try:
        from megatron.core.extensions.transformer_engine import HAVE_TE
    except Exception:  # TE present but broken (e.g. no CUDA): treat as absent
        return False
    return bool(HAVE_TE)


def resolve_backend(backend: LayerBackend | str, device_type: str) -> str:
    """``auto`` -> ``te`` on CUDA when TE imports, else ``local``."""
    backend = LayerBackend(backend)  # a config's value is one already; a caller's string may not be
    if backend == "auto":
        return "te" if device_type == "cuda" and te_installed() else "local"
    if backend == "te" and not te_installed():
        raise ValueError(
            "model.layer_backend='te' but transformer-engine is not importable "
            "(install loong-models[te] on a CUDA machine)"
        )
    return backend


class LocalSpecProvider(MegatronLocalSpecProvider):
    """The ``local`` backend as a megatron spec provider: megatron's local linears, with
    :class:`SDPAttention` as core attention and loong-kernels' RMSNorm."""

    def linear(self) -> type:
        """A linear not split over TP (MLA's down projections), as TESpecProvider.linear."""
        return ColumnParallelLinear

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False) -> type:
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        return RMSNorm if rms_norm else WrappedTorchNorm

    def core_attention(self) -> type:
        return SDPAttention


def spec_provider(backend: str) -> BackendSpecProvider:
    """The modules of a resolved backend (:func:`resolve_backend`): TE's, or the local ones."""
    if backend == "te":
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        return TESpecProvider()
    return LocalSpecProvider()


def decoder_block_spec(
    config: TransformerConfig, *, backend: str, vp_stage: int | None = None, deepstack: bool = False
):
    """Layer specs for the decoder layers of this pipeline stage, plus the final norm.

    ``te``: megatron-core's TE spec as is. ``local``: megatron-core's local modules with
    :class:`SDPAttention` as core attention and Loong's :class:`RMSNorm` for every norm.
    ``deepstack``: the layers are :class:`~loong_models.foundation.deepstack.DeepStackLayer`
    (the same modules; they add DeepStack vision features to their output).
    """
    block = _decoder_block_spec(config, backend=backend, vp_stage=vp_stage)
    if not deepstack:
        return block
    from loong_models.foundation.deepstack import DeepStackLayer

    layers = [dataclasses.replace(s, module=DeepStackLayer) for s in block.layer_specs]
    return dataclasses.replace(block, layer_specs=layers)


def _decoder_block_spec(config: TransformerConfig, *, backend: str, vp_stage: int | None = None):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    block = get_gpt_decoder_block_spec(
        config, use_transformer_engine=backend == "te", normalization="RMSNorm", vp_stage=vp_stage
    )
    provider = spec_provider(backend)
    if uses_sparse_attention(config):
        logger.debug(
            "layer spec: absorbed MLA + DeepSeek sparse attention (loong-kernels), %s linears", backend
        )
        layers = [_dsa_layer(s, provider) for s in block.layer_specs]
        return dataclasses.replace(
            block, layer_specs=layers, layer_norm=RMSNorm if backend == "local" else block.layer_norm
        )
    if backend == "te":
        logger.debug("layer spec: transformer-engine")
        return block
    logger.debug("layer spec: local megatron modules + SDPA + loong-kernels RMSNorm")
    return dataclasses.replace(
        block, layer_specs=[_local_layer(s, provider) for s in block.layer_specs], layer_norm=RMSNorm
    )


def mtp_block_spec(config: TransformerConfig, block, *, backend: str, vp_stage: int | None = None):
    """megatron's multi-token-prediction block (``config.mtp_num_layers``; None without MTP or on
    a stage that does not hold it): each MTP layer wraps a copy of the decoder's last layer spec;
    on the local backend its norms (enorm, hnorm, final) are Loong's RMSNorm like the decoder's."""
    if not config.mtp_num_layers:
        return None
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    spec = get_gpt_mtp_block_spec(config, block, use_transformer_engine=backend == "te", vp_stage=vp_stage)
    if spec is None or backend == "te":
        return spec
    norms = dict(enorm=RMSNorm, hnorm=RMSNorm, layer_norm=RMSNorm)
    layers = [dataclasses.replace(s, submodules=dataclasses.replace(s.submodules, **norms)) for s in spec.layer_specs]
    return dataclasses.replace(spec, layer_specs=layers)


# Per-head q/k norms (GQA: q_layernorm, k_layernorm) and latent norms (MLA: q_layernorm, kv_layernorm)
_ATTENTION_NORMS = ("q_layernorm", "k_layernorm", "kv_layernorm")


def _local_layer(spec: ModuleSpec, provider: BackendSpecProvider, rms_norm: bool = True) -> ModuleSpec:
    """megatron's local layer spec with the local provider's core attention and norms (GQA or
    MLA attention); the MLP (dense, or MoE: megatron's router, SequentialMLP experts and shared
    experts) stays megatron's local spec."""
    norm = provider.layer_norm(rms_norm=rms_norm)
    sub = spec.submodules
    attn = sub.self_attention
    attn_sub = attn.submodules
    norms = {k: norm for k in _ATTENTION_NORMS if getattr(attn_sub, k, IdentityOp) is not IdentityOp}
    attn_sub = dataclasses.replace(attn_sub, core_attention=provider.core_attention(), **norms)
    sub = dataclasses.replace(
        sub,
        self_attention=dataclasses.replace(attn, submodules=attn_sub),
        input_layernorm=norm,
        pre_mlp_layernorm=norm,
    )
    return dataclasses.replace(spec, submodules=sub)


def uses_sparse_attention(config: TransformerConfig) -> bool:
    """MLA with the DSA indexer configured (see foundation/build.py)."""
    return bool(getattr(config, "multi_latent_attention", False)) and config.dsa_indexer_topk is not None


def _dsa_attention(provider: BackendSpecProvider) -> ModuleSpec:
    from megatron.core.transformer.experimental_attention_variant.absorbed_mla import (
        AbsorbedMLASelfAttention,
        AbsorbedMLASelfAttentionSubmodules,
    )

    # the linears megatron's own DSA spec takes from its provider
    down, column, row = provider.linear(), provider.column_parallel_linear(), provider.row_parallel_linear()
    return ModuleSpec(
        module=AbsorbedMLASelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=AbsorbedMLASelfAttentionSubmodules(
            linear_q_proj=column,
            linear_q_down_proj=down,
            linear_q_up_proj=column,
            linear_kv_down_proj=down,
            linear_kv_up_proj=column,
            core_attention=ModuleSpec(
                module=DSAttention, submodules=DSAttentionSubmodules(indexer=LightningIndexer)
            ),
            linear_proj=row,
            # standalone (not fused into the up projections): the indexer reads the normed q latent
            q_layernorm=RMSNorm,
            kv_layernorm=RMSNorm,
        ),
    )


def _dsa_layer(spec: ModuleSpec, provider: BackendSpecProvider) -> ModuleSpec:
    norms = dict(input_layernorm=RMSNorm)
    if not provider.fuse_layernorm_and_linear():  # TE fuses it into the MLP's first linear
        norms["pre_mlp_layernorm"] = RMSNorm
    sub = dataclasses.replace(spec.submodules, self_attention=_dsa_attention(provider), **norms)
    return dataclasses.replace(spec, submodules=sub)


def fusion_fields(backend: str) -> dict[str, bool]:
    """TransformerConfig switches for fused kernels that exist only with the TE backend
    (fused RoPE, SwiGLU, bias-dropout-add, wgrad accumulation into main_grad, fused CE), and the
    MoE experts' implementation: TE's grouped GEMM (TEGroupedMLP) with TE, else megatron's
    SequentialMLP (one local MLP per expert; megatron's non-TE GroupedMLP needs the grouped_gemm
    package, which Loong does not require)."""
    on = backend == "te"
    return dict(
        moe_grouped_gemm=on,
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


def vision_block_spec(
    config: TransformerConfig, *, backend: str, window_layers: frozenset[int] = frozenset()
):
    """Layer specs of an image encoder (ViT): bidirectional attention over packed (THD) images.

    ``te``: megatron's TE layer (fused norm + linears, TE attention). ``local``: megatron's local
    modules with :class:`SDPAttention` (one SDPA per image / window segment) and Loong's RMSNorm,
    or megatron's torch LayerNorm for LayerNorm encoders. Layers in ``window_layers`` (0-based) are
    :class:`WindowAttentionLayer`: the same modules, attending within the windows of the packed
    parameters instead of whole images (Qwen2.5-VL).
    """
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from loong_models.image_encoder.layers import WindowAttentionLayer

    rms = config.normalization == "RMSNorm"
    provider = spec_provider(backend)
    final_norm = provider.layer_norm(rms_norm=rms)  # TENorm takes the norm type from config.normalization
    if backend == "te":
        base = get_gpt_layer_with_transformer_engine_spec()
    else:
        base = _local_layer(get_gpt_layer_local_spec(normalization=config.normalization), provider, rms)
    attn = base.submodules.self_attention
    attn = dataclasses.replace(attn, params={**attn.params, "attn_mask_type": AttnMaskType.no_mask})
    base = dataclasses.replace(base, submodules=dataclasses.replace(base.submodules, self_attention=attn))
    windowed = dataclasses.replace(base, module=WindowAttentionLayer)
    layers = [windowed if i in window_layers else base for i in range(config.num_layers)]
    logger.debug("vision layer spec: %s, %d window-attention layers", backend, len(window_layers))
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=final_norm)


def projector_mlp_spec(backend: str):
    """The image projector's two linears: column- then row-parallel (TE's on the TE backend)."""
    from megatron.core.transformer.mlp import MLPSubmodules

    provider = spec_provider(backend)
    return MLPSubmodules(
        linear_fc1=provider.column_parallel_linear(), linear_fc2=provider.row_parallel_linear()
    )


@dataclasses.dataclass(frozen=True)
class DiTModules:
    """The layer implementations of a diffusion transformer's blocks for one backend."""

    column_linear: type
    row_linear: type
    core_attention: type


def dit_modules(backend: str) -> DiTModules:
    """Column- / row-parallel linears and core attention of a DiT layer (Wan): TE's on the TE
    backend, megatron's local linears with :class:`SDPAttention` elsewhere."""
    p = spec_provider(backend)
    return DiTModules(p.column_parallel_linear(), p.row_parallel_linear(), p.core_attention())
