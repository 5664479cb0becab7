"""A model is a composition of components under the ``model`` config node: a ``foundation`` LLM,
and for VLMs an ``image_encoder`` and an ``image_projector`` (OmniCombinationModel)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.transformer_config import TransformerConfig
from omegaconf import OmegaConf

from loong_models import flops
from loong_models.diffusion import FlowMatchingConfig, WanConfig, WanModel, build_wan_transformer_config
from loong_models.diffusion.towers import TextEncoderConfig, VaeConfig
from loong_models.embodied.pi05 import Pi05Config
from loong_models.flops import Work
from loong_models.foundation import FoundationConfig, build_foundation, get_family
from loong_models.grouped_gemm import use_cublaslt_grouped_gemms
from loong_models.image_encoder import ImageEncoder, ImageEncoderConfig, build_encoder_transformer_config
from loong_models.image_projector import (
    ImageProjector,
    ImageProjectorConfig,
    build_projector_transformer_config,
)
from loong_models.lora import LoraConfig, apply_lora
from loong_models.omni import OmniCombinationModel, VisionTokenIds
from loong_models.specs import (
    AttentionBackend,
    GroupedGemmKernel,
    LayerBackend,
    resolve_backend,
    select_grouped_gemm_kernel,
)

CONFIG_DIR = Path(__file__).parent / "configs"
VISION_TOKEN_KEYS = tuple(f.name for f in dataclasses.fields(VisionTokenIds))  # also ModelConfig's keys


@dataclass
class ModelConfig:
    foundation: FoundationConfig = field(default_factory=FoundationConfig)
    # VLM components (both set, or both null for a text-only model).
    image_encoder: ImageEncoderConfig | None = None
    image_projector: ImageProjectorConfig | None = None
    # Vision token ids of the tokenizer (Qwen2.5-VL layout: <|vision_start|> <|image_pad|>...
    # <|vision_end|>); the pad tokens are replaced by the projected image / video features.
    image_token_id: int | None = None
    video_token_id: int | None = None
    vision_start_token_id: int | None = None
    vision_end_token_id: int | None = None
    # Multimodal RoPE: temporal position step per second of video (Qwen2.5-VL: 2).
    tokens_per_second: float = 2.0
    # Which layer implementations to use: auto (TE on CUDA when installed, else local), te, local.
    layer_backend: LayerBackend = LayerBackend.auto
    # TE's attention kernel: auto | flash | fused (cuDNN) | unfused; anything but auto needs TE layers
    attention_backend: AttentionBackend = AttentionBackend.auto
    # TE's kernel for the MoE experts' grouped GEMMs: auto | cublas | cutlass | cublaslt (specs.GroupedGemmKernel);
    # anything but auto needs TE layers and an MoE foundation
    grouped_gemm_kernel: GroupedGemmKernel = GroupedGemmKernel.auto
    # With TE layers: megatron's torch.compile'd bias-dropout-add (after attention and MLP) and
    # bias-SwiGLU, in every component; each call costs ~0.2 ms of host time (guards, AOT wrapper,
    # Triton launch), which a host-bound step (small layers, many of them) pays in wall time.
    fuse_bias_dropout_add: bool = True
    fuse_bias_activation: bool = True
    # With TE layers: every dense SwiGLU MLP (foundation, image encoder) as megatron's TEFusedMLP,
    # TE's operation fuser over norm, fc1, bias, SwiGLU and fc2: TE's CUDA kernels for bias +
    # SwiGLU and its backward, no torch.compile'd fusion (no host guards) and no eager elementwise
    # ops. Same parameters and checkpoint keys as the plain MLP; other MLPs stay megatron's MLP.
    # null (default): on unless something works through the MLP's linears (fused_mlp_conflicts).
    fused_mlp: bool | None = None
    # With TE layers: RoPE applied to the fused QKV projection's output in one TE kernel (megatron's
    # fused_single_qkv_rope): no split of Q, K, V before RoPE and no concatenation of their
    # gradients after. Not with packed (THD) sequences, QK norms, MLA or multimodal RoPE.
    fused_qkv_rope: bool = False
    # Low-rank adapters (null = off): freezes the adapted components' base weights.
    lora: LoraConfig | None = None
    # An embodied policy (model=pi05, pi05-tiny): a plain nn.Module built by loong_models.embodied,
    # not a megatron GPTModel; the foundation and VLM fields are then unused.
    embodied: Pi05Config | None = None

    @property
    def is_embodied(self) -> bool:
        return self.embodied is not None
    # Diffusion models (Wan): the denoising transformer, and the frozen VAE / text encoder that
    # make its inputs. With ``diffusion`` set the model is the DiT and ``foundation`` is unused.
    diffusion: WanConfig | None = None
    vae: VaeConfig | None = None
    text_encoder: TextEncoderConfig | None = None
    flow_matching: FlowMatchingConfig | None = None  # the DiT's objective (null: Wan's defaults)

    @property
    def is_diffusion(self) -> bool:
        return self.diffusion is not None

    @property
    def is_multimodal(self) -> bool:
        return self.image_encoder is not None

    @property
    def vision_token_ids(self) -> VisionTokenIds:
        """The vision token ids of a VLM (its ``*_token_id`` keys)."""
        return VisionTokenIds(**{key: getattr(self, key) for key in VISION_TOKEN_KEYS})

    def validate(self, prefix: str = "model") -> None:
        if self.embodied is not None:
            return self.embodied.validate(f"{prefix}.embodied")
        if self.is_diffusion:
            self._validate_diffusion(prefix)
            return
        self.foundation.validate(f"{prefix}.foundation")
        if self.grouped_gemm_kernel != "auto" and self.foundation.moe is None:
            raise ValueError(f"{prefix}.grouped_gemm_kernel={self.grouped_gemm_kernel} needs an MoE foundation "
                             f"({prefix}.foundation.moe is null): only the experts run grouped GEMMs")  # fmt: skip
        self._validate_fused_mlp(prefix)
        self._validate_fused_qkv_rope(prefix)
        if (self.image_encoder is None) != (self.image_projector is None):
            raise ValueError(f"{prefix}.image_encoder and {prefix}.image_projector must both be set (a VLM) "
                             "or both be null (a text-only model)")  # fmt: skip
        if self.image_encoder is None:
            return
        self.image_encoder.validate(f"{prefix}.image_encoder")
        if self.image_token_id is None:
            raise ValueError(f"{prefix}.image_token_id is required for a VLM (the id of <|image_pad|>)")
        for key in VISION_TOKEN_KEYS:
            v = getattr(self, key)
            if v is not None and not 0 <= v < self.foundation.vocab_size:
                raise ValueError(f"{prefix}.{key}={v} is outside the vocabulary (foundation.vocab_size="
                                 f"{self.foundation.vocab_size})")  # fmt: skip
        deep = len(self.image_encoder.deepstack_visual_indexes)
        if deep > self.foundation.num_layers:
            raise ValueError(f"{prefix}.image_encoder.deepstack_visual_indexes feeds {deep} foundation layers but "
                             f"{prefix}.foundation.num_layers={self.foundation.num_layers}")  # fmt: skip
        etp, ptp = (
            self.image_encoder.tensor_model_parallel_size,
            self.image_projector.tensor_model_parallel_size,
        )
        if ptp is not None and ptp != etp:
            raise ValueError(f"{prefix}.image_projector.tensor_model_parallel_size={ptp}: the projector runs on "
                             f"the encoder's group; use null or the encoder's size ({etp})")  # fmt: skip

    def fused_mlp_conflicts(self, prefix: str = "model", *, adaptive_runs_fp8: bool = True) -> list[str]:
        """The keys that rule out TE's op-fuser MLP, which runs fc1 and fc2 without calling their
        modules: LoRA adapters wrap those modules' forward, MoE experts have their own fused path,
        adaptive FP8's per-module decisions are read by each linear's forward (unless
        ``adaptive_runs_fp8`` is False: the policy decided BF16 everywhere, nothing reads them)."""
        conflicts = {
            f"{prefix}.lora": self.lora is not None,
            f"{prefix}.foundation.moe": self.foundation.moe is not None,
            f"{prefix}.foundation.precision.fp8=adaptive": self.foundation.precision.fp8 == "adaptive"
            and adaptive_runs_fp8,
        }
        return [key for key, conflict in conflicts.items() if conflict]

    def uses_fused_mlp(self, *, adaptive_runs_fp8: bool = True) -> bool:
        """``fused_mlp``, with null resolved: on unless :meth:`fused_mlp_conflicts` names a key
        (the layer backend decides whether TE builds the MLPs at all). ``adaptive_runs_fp8=False``
        once an adaptive policy turned out to pick BF16 for every GEMM kind: the model is then the
        plain BF16 one, op-fuser MLP included."""
        if self.fused_mlp is not None:
            return self.fused_mlp
        return not self.fused_mlp_conflicts(adaptive_runs_fp8=adaptive_runs_fp8)

    def _validate_fused_mlp(self, prefix: str) -> None:
        conflicts = self.fused_mlp_conflicts(prefix) if self.fused_mlp else []
        if conflicts:
            raise ValueError(f"{prefix}.fused_mlp=true cannot be combined with {conflicts[0]}: TE's op fuser runs "
                             f"the MLP's linears without calling their modules; set {prefix}.fused_mlp=false "
                             "(or null: on where it applies)")  # fmt: skip

    def _validate_fused_qkv_rope(self, prefix: str) -> None:
        """Megatron applies the fused QKV RoPE only to plain 1-D RoPE on an unnormalised Q and K
        (and asserts inside the forward otherwise): refuse the rest here, naming the key."""
        if not self.fused_qkv_rope:
            return
        f = self.foundation
        conflicts = {
            f"{prefix}.foundation.mla": f.mla is not None,
            f"{prefix}.foundation.mrope_section": f.mrope_section is not None,
            f"{prefix}.foundation.family={f.family} (QK norms)": get_family(f.family).qk_norm,
            f"{prefix}.foundation.extra.attention_output_gate": bool(f.extra.get("attention_output_gate")),
        }
        conflicts = [key for key, conflict in conflicts.items() if conflict]
        if conflicts:
            raise ValueError(f"{prefix}.fused_qkv_rope=true cannot be combined with {conflicts[0]}: megatron's "
                             "fused QKV RoPE takes plain 1-D RoPE on unnormalised, ungated queries and keys; "
                             f"set {prefix}.fused_qkv_rope=false")  # fmt: skip

    def layout_shape(self) -> dict[str, Any]:
        """What a parallel layout must divide: the trained transformer's layers, heads, KV groups
        and experts (the foundation's, or a diffusion model's DiT)."""
        if self.diffusion is not None:
            d = self.diffusion
            return dict(num_layers=d.num_layers, num_attention_heads=d.num_attention_heads,
                        query_groups=d.num_attention_heads, moe=None)  # fmt: skip
        f = self.foundation
        return dict(num_layers=f.num_layers, num_attention_heads=f.num_attention_heads, query_groups=f.query_groups,
                    moe=f.moe)  # fmt: skip

    def _validate_diffusion(self, prefix: str) -> None:
        assert self.diffusion is not None
        self.diffusion.validate(f"{prefix}.diffusion")
        if self.flow_matching is not None:
            self.flow_matching.validate(f"{prefix}.flow_matching")
        if self.image_encoder is not None or self.lora is not None:
            raise ValueError(f"{prefix}.diffusion: image_encoder / lora are not supported with a diffusion model")
        if self.vae is not None:
            self.vae.validate(f"{prefix}.vae")
            if self.vae.z_dim != self.diffusion.out_channels:
                raise ValueError(f"{prefix}.vae.z_dim={self.vae.z_dim} != {prefix}.diffusion.out_channels="
                                 f"{self.diffusion.out_channels}")  # fmt: skip
        if self.text_encoder is not None:
            self.text_encoder.validate(f"{prefix}.text_encoder")
            if self.text_encoder.d_model != self.diffusion.text_dim:
                raise ValueError(f"{prefix}.text_encoder.d_model={self.text_encoder.d_model} != "
                                 f"{prefix}.diffusion.text_dim={self.diffusion.text_dim}")  # fmt: skip

    def num_parameters(self) -> int:
        """Exact parameter count of what gets built (unpadded vocab), all components."""
        if self.embodied is not None:
            return self.embodied.num_parameters()
        if self.diffusion is not None:
            return self.diffusion.num_parameters()
        n = self.foundation.num_parameters()
        if self.image_encoder is not None:
            e = self.image_encoder
            n += e.num_parameters()
            n += self.image_projector.num_parameters(
                e.hidden_size, e.spatial_merge_size, self.foundation.hidden_size, len(e.deepstack_visual_indexes)
            )
        return n

    def check_tokenizer(
        self, vocab_size: int, vision: VisionTokenIds | None = None, *, source: str = "the tokenizer"
    ) -> None:
        """Raise ValueError naming the key when a tokenizer's ids do not fit this model: its
        vocabulary, and (``vision``: the tokenizer's, e.g. loong-data's ChatTokenizer.vision) a
        VLM's vision token ids."""
        if self.image_encoder is not None and vision is not None:
            for key in VISION_TOKEN_KEYS:
                mine, theirs = getattr(self, key), getattr(vision, key)
                if mine is not None and mine != theirs:
                    raise ValueError(f"model.{key}={mine} but the tokenizer ({source}) has id {theirs} for "
                                     f"that token; set model.{key}={theirs}")  # fmt: skip
        if self.text_encoder is not None and vocab_size > self.text_encoder.vocab_size:
            raise ValueError(f"model.text_encoder.vocab_size={self.text_encoder.vocab_size} is smaller than the "
                             f"tokenizer's vocabulary ({vocab_size}, {source})")  # fmt: skip
        if self.diffusion is not None:
            return
        key, size = ("embodied", self.embodied.vocab_size) if self.embodied else ("foundation", self.foundation.vocab_size)
        if vocab_size > size:
            raise ValueError(f"model.{key}.vocab_size={size} is smaller than the "
                             f"tokenizer's vocabulary ({vocab_size}, {source})")  # fmt: skip

    def work(self, sample_lengths: Iterable[int] = (), grids: Iterable[Sequence[int]] = ()) -> Work:
        """The additive counts (:class:`loong_models.flops.Work`) of samples of these real token
        counts and images / videos of these ``(t, h, w)`` patch grids."""
        return flops.work(self, sample_lengths, grids)

    def training_flops(self, counts: Work) -> float:
        """Training FLOPs of ``counts`` (forward + backward; loong_models.flops): what the
        trainer's MFU and the benches count."""
        return flops.training_flops(self, counts)


def zoo_names() -> list[str]:
    return sorted(p.stem for p in (CONFIG_DIR / "model").glob("*.yaml"))


def load_model_config(name: str, overrides: list[str] | None = None) -> ModelConfig:
    """Compose ``model=<name>`` from the zoo without the train app, e.g.
    ``load_model_config("qwen3-0.6b", ["foundation.num_layers=2"])``; ``+key=value`` adds a key."""
    from hydra import compose, initialize_config_dir

    if name not in zoo_names():
        raise ValueError(f"model={name!r} is not in the zoo; available: {', '.join(zoo_names())}")

    def scoped(o: str) -> str:
        # component swaps (model/foundation=llama3-8b) and +additions keep their prefix outside
        if o.startswith(("model/", "+model", "~model")):
            return o
        if o.startswith(("+", "~")):
            return f"{o[0]}model.{o[1:]}"
        if "/" in o.split("=", 1)[0]:
            return f"model/{o}"
        return f"model.{o}"

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        raw = compose(config_name=f"model/{name}", overrides=[scoped(o) for o in overrides or []])
    return to_model_config(raw.model)


def to_model_config(raw) -> ModelConfig:
    """Validate a composed ``model`` node against the schema (unknown keys and bad types raise,
    naming the key) and return the typed config."""
    merged = OmegaConf.merge(OmegaConf.structured(ModelConfig), raw)
    cfg: ModelConfig = OmegaConf.to_object(merged)
    cfg.validate()
    if cfg.lora is not None:
        cfg.lora.validate()
    return cfg


def encoder_tensor_parallel_size(cfg: ModelConfig, foundation_tp: int) -> int:
    """The image encoder's TP size: its own key, else the foundation's; it must divide the
    foundation's (each encoder group lies inside one foundation TP group)."""
    assert cfg.image_encoder is not None
    etp = cfg.image_encoder.tensor_model_parallel_size or foundation_tp
    if foundation_tp % etp:
        raise ValueError(f"model.image_encoder.tensor_model_parallel_size={etp} must divide the foundation's "
                         f"tensor-parallel size {foundation_tp}")  # fmt: skip
    if 1 < etp < foundation_tp:
        raise ValueError(f"model.image_encoder.tensor_model_parallel_size={etp}: supported are 1 (replicated "
                         f"encoder) or the foundation's size {foundation_tp}")  # fmt: skip
    return etp


def build_model(
    cfg: ModelConfig,
    config: TransformerConfig,
    *,
    device_type: str,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: int | None = None,
    encoder_pg_collection: ProcessGroupCollection | None = None,
    layer_backend: str | None = None,
    encoder_on_every_stage: bool = False,
):
    """Build this rank's pipeline stage of the model described by ``cfg``: a megatron GPTModel for a
    text-only model, an :class:`OmniCombinationModel` for a VLM.

    ``config`` is the foundation's TransformerConfig. The encoder and projector get their own,
    with the foundation's precision and their own TP size; ``encoder_pg_collection`` holds their
    process groups when that size differs from the foundation's (see
    ``loong_parallel.component_process_groups``); otherwise megatron's global groups are used.
    ``layer_backend``: the resolved backend (:func:`resolve_backend`), resolved here when None.
    ``encoder_on_every_stage``: a VLM's encoder and projector on every pipeline stage, not only the
    first (``loong_parallel.encoder_layout``'s ``decoupled`` layout encodes on all of them).
    """
    backend = layer_backend or resolve_backend(cfg.layer_backend, device_type)
    if cfg.diffusion is not None:
        return _build_diffusion(cfg, config, backend)
    foundation = build_foundation(
        cfg.foundation,
        config,
        layer_backend=backend,
        pre_process=pre_process,
        post_process=post_process,
        vp_stage=vp_stage,
        scatter_embedding_sequence_parallel=not cfg.is_multimodal,
        deepstack=cfg.is_multimodal and bool(cfg.image_encoder.deepstack_visual_indexes),
    )
    if backend == "te" and cfg.foundation.moe is not None:
        select_grouped_gemm_kernel(cfg.grouped_gemm_kernel)  # TE reads the switch on every call
        if cfg.grouped_gemm_kernel == "cublaslt":
            use_cublaslt_grouped_gemms(foundation, config.params_dtype)
    if not cfg.is_multimodal:
        return _with_lora(cfg, foundation, {"foundation": foundation})
    enc_cfg, proj_cfg = cfg.image_encoder, cfg.image_projector
    assert enc_cfg is not None and proj_cfg is not None
    ftp = config.tensor_model_parallel_size
    etp = encoder_tensor_parallel_size(cfg, ftp)
    if etp != ftp and encoder_pg_collection is None:
        raise ValueError(f"model.image_encoder.tensor_model_parallel_size={etp} differs from the foundation's "
                         f"{ftp}: pass encoder_pg_collection (loong_parallel.component_process_groups)")  # fmt: skip
    encoder = projector = None
    if pre_process or encoder_on_every_stage:  # the encoder and projector live on the first pipeline stage
        econfig = build_encoder_transformer_config(
            enc_cfg, config, tensor_model_parallel_size=etp, backend=backend
        )
        encoder = ImageEncoder(enc_cfg, econfig, layer_backend=backend, pg_collection=encoder_pg_collection)
        pconfig = build_projector_transformer_config(
            proj_cfg, config, encoder_hidden=enc_cfg.hidden_size, merge=enc_cfg.spatial_merge_size,
            out_size=cfg.foundation.hidden_size, tensor_model_parallel_size=etp, backend=backend,
        )  # fmt: skip
        projector = ImageProjector(
            proj_cfg, pconfig, encoder_hidden=enc_cfg.hidden_size, merge=enc_cfg.spatial_merge_size,
            layer_backend=backend, tp_group=encoder_pg_collection.tp if encoder_pg_collection is not None else None,
            num_deepstack=len(enc_cfg.deepstack_visual_indexes),
        )  # fmt: skip
        if pre_process:
            _check_deepstack_stage(foundation, len(enc_cfg.deepstack_visual_indexes))
        for module, component in ((encoder, enc_cfg), (projector, proj_cfg)):
            _apply_component_settings(module, component.freeze, replicated=etp < ftp, copy=not pre_process)
    model = OmniCombinationModel(
        config, foundation, encoder, projector,
        token_ids=cfg.vision_token_ids,
        spatial_merge_size=enc_cfg.spatial_merge_size,
        mrope=cfg.foundation.mrope_section is not None,
        tokens_per_second=cfg.tokens_per_second,
        encoder_on_every_stage=encoder_on_every_stage,
    )  # fmt: skip
    # encoder and projector: None on pipeline stages after the first (unless encoder_on_every_stage)
    return _with_lora(cfg, model, {"foundation": foundation, "image_encoder": encoder, "image_projector": projector})


def _check_deepstack_stage(foundation: torch.nn.Module, layers: int) -> None:
    """DeepStack features enter on the first pipeline stage: it must hold the layers they feed."""
    held = {layer.layer_number for layer in foundation.decoder.layers}
    missing = sorted(set(range(1, layers + 1)) - held)
    if missing:
        raise ValueError(f"model.image_encoder.deepstack_visual_indexes feeds foundation layers 0..{layers - 1}, "
                         f"but the first pipeline stage lacks layers {[m - 1 for m in missing]}; "
                         "use fewer pipeline stages or a layout that puts them there")  # fmt: skip


def _build_diffusion(cfg: ModelConfig, config: TransformerConfig, backend: str) -> WanModel:
    """The Wan DiT, with the runtime's precision and TP size (``config`` is the foundation's
    TransformerConfig: only its runtime fields are read)."""
    assert cfg.diffusion is not None
    tp = cfg.diffusion.tensor_model_parallel_size or config.tensor_model_parallel_size
    if tp != config.tensor_model_parallel_size:
        raise ValueError(f"model.diffusion.tensor_model_parallel_size={tp} must equal the run's "
                         f"tensor-parallel size {config.tensor_model_parallel_size}")  # fmt: skip
    wconfig = build_wan_transformer_config(cfg.diffusion, config, tensor_model_parallel_size=tp, backend=backend)
    model = WanModel(cfg.diffusion, wconfig, layer_backend=backend)
    _apply_component_settings(model, cfg.diffusion.freeze, replicated=False)
    return model


def _with_lora(cfg: ModelConfig, model: torch.nn.Module, components: dict) -> torch.nn.Module:
    """LoRA adapters on the components ``cfg.lora`` names (applied last: after the components'
    own freeze / replication settings, whose flags the adapters inherit)."""
    if cfg.lora is not None:
        apply_lora(components, cfg.lora)
    return model


def _apply_component_settings(
    module: torch.nn.Module, freeze: bool, *, replicated: bool, copy: bool = False
) -> None:
    for p in module.parameters():
        if freeze:
            p.requires_grad_(False)
        if copy:  # a later pipeline stage's copy of the first stage's module: the grad norm counts it once
            p.shared = True
        if replicated:
            # Encoder TP smaller than the foundation's: every rank of a foundation TP group holds the
            # whole encoder and computes it on the same inputs. megatron's finalize_model_grads
            # averages gradients tagged like this over the TP group (bitwise-identical replicas
            # even with non-deterministic kernels), and the grad norm counts them once (TP rank 0).
            p.average_gradients_across_tp_domain = True
            p.tensor_model_parallel = False
