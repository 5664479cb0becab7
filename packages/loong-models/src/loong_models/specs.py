"""The one place that decides which implementation each layer uses.

A resolved backend (:func:`resolve_backend`) is one megatron spec provider
(:func:`spec_provider`): megatron's ``TESpecProvider`` (CUDA with Transformer Engine installed:
fused norms + linears, TE/cuDNN attention), or :class:`LocalSpecProvider` everywhere else
(megatron's local modules with :class:`SDPAttention` as core attention, no materialised attention
matrix, and loong-kernels' RMSNorm). Every spec is built from the provider's answers: the GPT
decoder's layers (:func:`layer_spec`, laid out as megatron-core's GPT layer specs, whose builders
take no provider), the MTP block, the ViT, the projector and the DiT.

Mixture-of-Experts layers (``num_moe_experts`` set) take megatron's MoE spec of the provider:
TE's grouped-GEMM experts (``TEGroupedMLP``, ``moe_grouped_gemm`` from :func:`fusion_fields`)
with TE, megatron's ``SequentialMLP`` locally; router, shared experts and token dispatcher are
megatron's. MLA without sparse attention (DeepSeek-V3) is megatron's ``MLASelfAttention``.

DeepSeek sparse attention (MLA config with ``dsa_indexer_topk`` set), on either backend:
megatron's ``AbsorbedMLASelfAttention`` (the backend's linears) with Loong's
:class:`DSAttention` as core attention (loong-kernels: TileLang on CUDA, torch elsewhere) and
Loong's RMSNorm for the layer-input and latent norms; the MLP stays the backend's.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Sequence
from enum import StrEnum

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import BackendSpecProvider
from megatron.core.models.backends import LocalSpecProvider as MegatronLocalSpecProvider
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from loong_models.attention import DSAttention, DSAttentionSubmodules, LightningIndexer, SDPAttention
from loong_models.log import logger
from loong_models.norm import RMSNorm, tp_replicated


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


class GroupedGemmKernel(StrEnum):
    """TE's kernel for the MoE experts' grouped GEMMs (``model.grouped_gemm_kernel``). Only with
    TE layers and an MoE foundation."""

    auto = "auto"  # TE's default: one cuBLAS GEMM per expert on a pool of streams (or as NVTE_* says)
    cublas = "cublas"  # one cuBLAS GEMM per expert, whatever the environment says
    # Hopper, BF16/FP16: one CUTLASS grouped kernel for all of a layer's experts wherever TE can
    # (uniform K, a multiple of 128: the forward and data-gradient GEMMs); the weight gradients,
    # whose K is each expert's token count, and other GPUs keep cuBLAS. One launch instead of one
    # per expert: less host time a micro-batch, which a host-bound MoE step pays in wall time.
    cutlass = "cutlass"
    # TE's cuBLASLt grouped GEMM on grouped tensors (Hopper: cuBLASLt >= 13.4; BF16/FP16): one
    # launch per grouped GEMM, the weight gradients' included, with the split sizes on the device
    # (loong_models.grouped_gemm). FP8 recipes the path lacks fall back to TE's per-expert GEMMs,
    # which then read the split sizes back to the host on every call: use cublas or cutlass there.
    cublaslt = "cublaslt"


# TE reads this switch from the process environment on every grouped GEMM (as megatron's
# attention_backend sets TE's NVTE_*_ATTN switches): there is no per-module argument.
GROUPED_GEMM_ENV = "NVTE_USE_CUTLASS_GROUPED_GEMM"


def select_grouped_gemm_kernel(choice: GroupedGemmKernel | str) -> None:
    """Set TE's grouped-GEMM switch for ``choice``; ``auto`` leaves the environment as it is.
    (``cublaslt`` turns the CUTLASS switch off; its modules are switched by
    :func:`loong_models.grouped_gemm.use_cublaslt_grouped_gemms`.)"""
    choice = GroupedGemmKernel(choice)
    if choice != GroupedGemmKernel.auto:
        os.environ[GROUPED_GEMM_ENV] = "1" if choice == GroupedGemmKernel.cutlass else "0"
        logger.info("MoE experts' grouped GEMMs: %s (%s=%s)", choice, GROUPED_GEMM_ENV, os.environ[GROUPED_GEMM_ENV])


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
        """MLA's down projections, as megatron's local spec: column-parallel, MLA gathers their
        outputs (TE: a TP-duplicated TELinear; loong_xpu.mla_rope_key sums the shared RoPE key's
        gradient over TP for both)."""
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
    """Layer specs for the decoder layers of this pipeline stage, plus the final norm, all from
    the backend's spec provider (``local``: :class:`SDPAttention` and Loong's :class:`RMSNorm`).
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
    provider = spec_provider(backend)
    pattern = _moe_layer_pattern(config)
    kinds = {moe: _decoder_layer(config, provider, moe=bool(moe)) for moe in set(pattern)}
    if config.mrope_section is not None and not config.multi_latent_attention:
        kinds = {moe: token_rope_attention(spec, backend) for moe, spec in kinds.items()}
    layers = [kinds[moe] for moe in pattern]
    logger.debug(
        "layer spec: %s%s", backend, " + DeepSeek sparse attention" if uses_sparse_attention(config) else ""
    )
    return TransformerBlockSubmodules(
        layer_specs=[layers[i] for i in _stage_layer_ids(config, vp_stage)],
        layer_norm=provider.layer_norm(rms_norm=True),
    )


def _decoder_layer(config: TransformerConfig, provider: BackendSpecProvider, *, moe: bool) -> ModuleSpec:
    shape = LayerShape(
        qk_layernorm=config.qk_layernorm,
        multi_latent_attention=config.multi_latent_attention,
        num_experts=config.num_moe_experts if moe else None,
        moe_grouped_gemm=moe and config.moe_grouped_gemm,
        te_activation_func=config.use_te_activation_func,
        te_op_fuser=uses_te_op_fuser(config),  # layer_spec applies it to dense MLPs only
    )
    spec = layer_spec(provider, shape)
    return _dsa_layer(spec, provider) if uses_sparse_attention(config) else spec


def _moe_layer_pattern(config: TransformerConfig) -> list[int]:
    """megatron's ``moe_layer_freq``: 1 = MoE layer, 0 = dense (an int N: every N-th layer)."""
    n, freq = config.num_layers, config.moe_layer_freq
    if config.num_moe_experts is None:
        return [0] * n
    if isinstance(freq, int):
        return [int(i % freq == 0) for i in range(n)]
    if len(freq) != n:
        raise ValueError(f"moe_layer_freq has {len(freq)} entries for {n} layers")
    return list(freq)


def _stage_layer_ids(config: TransformerConfig, vp_stage: int | None) -> Sequence[int]:
    """The decoder layers this pipeline stage builds (megatron's layout or even split)."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if config.pipeline_model_parallel_layout is not None:
        return config.pipeline_model_parallel_layout.get_layer_id_list(
            layer_type=LayerType.decoder, vp_stage=vp_stage
        )
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    return range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage))


def mtp_block_spec(config: TransformerConfig, block, *, backend: str, vp_stage: int | None = None):
    """megatron's multi-token-prediction block (``config.mtp_num_layers``; None without MTP or on
    a stage that does not hold it): each MTP layer wraps a copy of the decoder's last layer spec,
    its projection and norms (enorm, hnorm, final) the provider's, RMSNorm like the decoder's."""
    if not config.mtp_num_layers:
        return None
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec_for_backend

    provider = spec_provider(backend)
    spec = get_gpt_mtp_block_spec_for_backend(config, block, backend=provider, vp_stage=vp_stage)
    if spec is None:
        return None
    norm = provider.layer_norm(rms_norm=True)
    norms = dict(enorm=norm, hnorm=norm, layer_norm=norm)
    layers = [
        dataclasses.replace(s, submodules=dataclasses.replace(s.submodules, **norms))
        for s in spec.layer_specs
    ]
    return dataclasses.replace(spec, layer_specs=layers)


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """What a transformer layer's spec depends on besides the backend."""

    rms_norm: bool = True  # False: LayerNorm
    qk_layernorm: bool = False  # per-head q/k norms (GQA) or latent norms (MLA)
    multi_latent_attention: bool = False
    num_experts: int | None = None  # an MoE layer's routed experts; None: a dense MLP
    moe_grouped_gemm: bool = False
    te_activation_func: bool = False
    te_op_fuser: bool = False  # a dense MLP as megatron's TEFusedMLP (TE's operation fuser)


def uses_te_op_fuser(config: TransformerConfig) -> bool:
    """Whether dense MLPs are TE's op-fuser MLP: asked for (``use_transformer_engine_op_fuser``,
    model.fused_mlp) and SwiGLU. Other activations keep megatron's MLP: TE's op for ``F.gelu``
    is its tanh approximation, and it has none for the rest."""
    import torch.nn.functional as F

    return bool(config.use_transformer_engine_op_fuser and config.gated_linear_unit
                and config.activation_func is F.silu)  # fmt: skip


# The keys a layer's norms and MLP checkpoint under, as megatron's GPT specs name them, so that
# checkpoints of either backend load into the other: TE's op-fuser MLP names its parts by index;
# the separate norms of an unfused backend take the names of TE's fused layer-norm linears.
_FUSED_KEYS = {
    "mlp.0.weight": "mlp.linear_fc1.layer_norm_weight",
    "mlp.0.bias": "mlp.linear_fc1.layer_norm_bias",
    "mlp.1.basic_ops.0.weight": "mlp.linear_fc1.weight",
    "mlp.1.basic_ops.1.bias": "mlp.linear_fc1.bias",
    "mlp.3.basic_ops.0.weight": "mlp.linear_fc2.weight",
    "mlp.3.basic_ops.1.bias": "mlp.linear_fc2.bias",
}
_UNFUSED_KEYS = {
    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
}


def layer_spec(provider: BackendSpecProvider, shape: LayerShape) -> ModuleSpec:
    """A megatron TransformerLayer (GQA or MLA attention, dense or MoE MLP) with every module from
    ``provider``, laid out as megatron-core's GPT layer specs: a backend that fuses a norm into the
    next linear (TE) has no separate input norm before GQA's qkv nor pre-MLP norm before a dense MLP."""
    from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend

    fused = provider.fuse_layernorm_and_linear()
    norm = provider.layer_norm(rms_norm=shape.rms_norm, has_residual=True)
    mla = shape.multi_latent_attention
    mlp = get_mlp_module_spec_for_backend(
        provider, num_experts=shape.num_experts, moe_grouped_gemm=shape.moe_grouped_gemm,
        use_te_activation_func=shape.te_activation_func,
        use_te_op_fuser=shape.te_op_fuser and fused and shape.num_experts is None,
    )  # fmt: skip
    sub = TransformerLayerSubmodules(
        input_layernorm=IdentityOp if fused and not mla else norm,
        self_attention=(_mla_attention if mla else _gqa_attention)(provider, shape),
        self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=IdentityOp if fused and shape.num_experts is None else norm,
        mlp=mlp,
        mlp_bda=get_bias_dropout_add,
        sharded_state_dict_keys_map={} if mla else dict(_FUSED_KEYS if fused else _UNFUSED_KEYS),
    )
    return ModuleSpec(module=TransformerLayer, submodules=sub)


def _gqa_attention(provider: BackendSpecProvider, shape: LayerShape) -> ModuleSpec:
    qk_norm = provider.layer_norm(rms_norm=shape.rms_norm, for_qk=True) if shape.qk_layernorm else IdentityOp
    fused = provider.fuse_layernorm_and_linear()
    return ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=provider.column_parallel_layer_norm_linear()
            if fused
            else provider.column_parallel_linear(),
            core_attention=provider.core_attention(),
            linear_proj=provider.row_parallel_linear(),
            q_layernorm=qk_norm,
            k_layernorm=qk_norm,
        ),
    )


def token_rope_attention(layer: ModuleSpec, backend: str) -> ModuleSpec:
    """``layer`` with :class:`TokenRopeSelfAttention` (models whose rotary table has one row per
    token: multimodal RoPE, a ViT's 2-D RoPE), TE's fused RoPE kernel on the TE backend."""
    from loong_models.attention.token_rope import TokenRopeSelfAttention

    attn = layer.submodules.self_attention
    attn = dataclasses.replace(attn, module=TokenRopeSelfAttention,
                               params={**attn.params, "fused_rope": backend == "te"})  # fmt: skip
    return dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, self_attention=attn))


def _mla_attention(provider: BackendSpecProvider, shape: LayerShape) -> ModuleSpec:
    """megatron's MLASelfAttention; a fusing backend folds the latent norms into the up projections."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention, MLASelfAttentionSubmodules

    fused = provider.fuse_layernorm_and_linear()
    column = provider.column_parallel_linear()
    up = provider.column_parallel_layer_norm_linear() if fused and shape.qk_layernorm else column
    norm = provider.layer_norm(rms_norm=shape.rms_norm, for_qk=True)
    latent_norm = tp_replicated(norm) if shape.qk_layernorm else IdentityOp
    return ModuleSpec(
        module=MLASelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=MLASelfAttentionSubmodules(
            linear_q_proj=column,
            linear_q_down_proj=provider.linear(),
            linear_q_up_proj=up,
            linear_kv_down_proj=provider.linear(),
            linear_kv_up_proj=up,
            core_attention=provider.core_attention(),
            linear_proj=provider.row_parallel_linear(),
            q_layernorm=IdentityOp if fused else latent_norm,
            kv_layernorm=IdentityOp if fused else latent_norm,
        ),
    )


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


def fusion_fields(
    backend: str, *, bias_dropout_add: bool = True, bias_activation: bool = True, fused_mlp: bool = False,
    fused_qkv_rope: bool = False,
) -> dict[str, bool]:
    """TransformerConfig switches for fused kernels that exist only with the TE backend
    (fused RoPE, SwiGLU, bias-dropout-add, wgrad accumulation into main_grad, fused CE), and the
    MoE experts' implementation: TE's grouped GEMM (TEGroupedMLP) with TE, else megatron's
    SequentialMLP (one local MLP per expert; megatron's non-TE GroupedMLP needs the grouped_gemm
    package, which Loong does not require).

    ``bias_dropout_add`` / ``bias_activation`` (``model.fuse_bias_dropout_add`` /
    ``model.fuse_bias_activation``): megatron's torch.compile'd elementwise fusions, each call of
    which pays Dynamo's guards, the AOT wrapper and a Triton launch on the host (~0.2 ms a call,
    measured on an H100 host); off, the same math runs as eager ops.

    ``fused_mlp`` (``model.fused_mlp``): megatron's ``use_transformer_engine_op_fuser``, which
    :func:`layer_spec` reads for dense SwiGLU MLPs (TE's op-fuser MLP, :func:`uses_te_op_fuser`)."""
    on = backend == "te"
    return dict(
        use_transformer_engine_op_fuser=on and fused_mlp,
        moe_grouped_gemm=on,
        apply_rope_fusion=on,
        fused_single_qkv_rope=on and fused_qkv_rope,
        bias_activation_fusion=on and bias_activation,
        bias_dropout_fusion=on and bias_dropout_add,
        masked_softmax_fusion=False,  # unused: attention is TE's or SDPA
        # megatron's flag refuses to build its own linears without apex: parallel.wgrad_fusion
        # switches the built modules instead (loong_parallel.model.fuse_wgrad_accumulation).
        gradient_accumulation_fusion=False,
        cross_entropy_loss_fusion=on,
        **({"cross_entropy_fusion_impl": "te"} if on else {}),
    )


def vision_block_spec(
    config: TransformerConfig, *, backend: str, window_layers: frozenset[int] = frozenset(), attention: str = "sdpa"
):
    """Layer specs of an image encoder (ViT): bidirectional attention over packed (THD) images.

    ``te``: megatron's TE layer (fused norm + linears). ``local``: megatron's local modules with
    Loong's RMSNorm, or megatron's torch LayerNorm for LayerNorm encoders. Core attention
    (``attention="sdpa"``) is :class:`SDPAttention` on both: one batched SDPA per segment length
    (the windows / frames of equal-sized images: one call), torch's flash kernel on CUDA. cuDNN's
    THD attention backward (TE's, ``attention="backend"``) ran a preprocessing kernel of ~4.5 ms
    per layer at Qwen2.5-VL's head dim 80 on an H100, a third of a training step. Layers in ``window_layers`` (0-based) are
    :class:`WindowAttentionLayer`: the same modules, attending within the windows of the packed
    parameters instead of whole images (Qwen2.5-VL).
    """
    from loong_models.image_encoder.layers import WindowAttentionLayer

    rms = config.normalization == "RMSNorm"
    provider = spec_provider(backend)
    final_norm = provider.layer_norm(rms_norm=rms)  # TENorm takes the norm type from config.normalization
    base = layer_spec(provider, LayerShape(rms_norm=rms, te_op_fuser=uses_te_op_fuser(config)))
    attn = base.submodules.self_attention
    core = SDPAttention if attention == "sdpa" else attn.submodules.core_attention
    attn = dataclasses.replace(attn, params={**attn.params, "attn_mask_type": AttnMaskType.no_mask},
                               submodules=dataclasses.replace(attn.submodules, core_attention=core))  # fmt: skip
    base = dataclasses.replace(base, submodules=dataclasses.replace(base.submodules, self_attention=attn))
    base = token_rope_attention(base, backend)  # 2-D RoPE: one rotary row per patch
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
