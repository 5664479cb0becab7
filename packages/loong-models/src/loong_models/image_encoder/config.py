"""The image encoder (ViT) component's config: the schema its YAML files fill, the encoder types
it can be, and exact parameter counts computed without building anything."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from loong_models.choices import Activation, Norm, Recompute


class EncoderAttention(StrEnum):
    """The ViT's core attention (``model.image_encoder.attention``)."""

    sdpa = "sdpa"  # Loong's SDPAttention with every layer backend: one batched SDPA per segment length
    backend = "backend"  # the layer backend's own (TE: cuDNN's THD attention; local: SDPAttention too)


@dataclass(frozen=True)
class EncoderType:
    """What distinguishes one ViT design from another; sizes come from the YAML."""

    name: str
    normalization: Norm
    gated_mlp: bool  # SwiGLU-style gate (gate and up projections fused into linear_fc1)
    activation: Activation
    patch_bias: bool  # bias on the patch embedding
    rope_2d: bool  # 2-D RoPE on (row, column) of each patch (Qwen2-VL / 2.5-VL)
    learned_positions: bool  # a learned position table added after the patch embedding (SigLIP)
    windows: bool  # window attention in the layers not in fullatt_block_indexes (Qwen2.5-VL)
    post_norm: bool  # a final norm after the last layer (SigLIP's post_layernorm)
    hf_model_type: str = ""
    # how the learned position table is resized to another grid: "bicubic" (SigLIP, as HF's
    # interpolate_pos_encoding) or "bilinear_corners" (Qwen3-VL: bilinear, align_corners=True)
    position_interpolation: str = "bicubic"
    # The MLP width Loong builds is ffn_hidden_size rounded up to a multiple of this (the
    # config's pad_ffn_to overrides it): Qwen2.5-VL's 3420 is not a multiple of 8, so cuBLAS
    # runs every ViT MLP GEMM on slow unaligned (align2) kernels. The padding is zero and stays
    # zero (see ImageEncoderConfig.padded_ffn_hidden_size); checkpoints convert without it.
    ffn_pad: int = 1


ENCODER_TYPES: dict[str, EncoderType] = {
    t.name: t
    for t in (
        EncoderType("qwen2.5-vit", normalization=Norm.RMSNorm, gated_mlp=True, activation=Activation.silu,
                    patch_bias=False, rope_2d=True, learned_positions=False, windows=True, post_norm=False,
                    hf_model_type="qwen2_5_vl", ffn_pad=64),
        EncoderType("siglip", normalization=Norm.LayerNorm, gated_mlp=False, activation=Activation.gelu_tanh,
                    patch_bias=True, rope_2d=False, learned_positions=True, windows=False, post_norm=True,
                    hf_model_type="siglip_vision_model"),
        # Qwen3-VL: LayerNorm, GELU (tanh) MLP, biased patch embedding, learned positions
        # (bilinear-resized) added to the patches *and* 2-D RoPE in attention; DeepStack features
        # from deepstack_visual_indexes (the projector merges them, the foundation adds them)
        EncoderType("qwen3-vit", normalization=Norm.LayerNorm, gated_mlp=False, activation=Activation.gelu_tanh,
                    patch_bias=True, rope_2d=True, learned_positions=True, windows=False, post_norm=False,
                    hf_model_type="qwen3_vl", position_interpolation="bilinear_corners"),
    )
}  # fmt: skip


# The names of ENCODER_TYPES, the type of the config's ``type`` field (OmegaConf names the allowed ones).
EncoderTypeName = StrEnum("EncoderTypeName", {name: name for name in ENCODER_TYPES}, module=__name__)


def get_encoder_type(name: str) -> EncoderType:
    return ENCODER_TYPES[name]


@dataclass
class ImageEncoderConfig:
    """A ViT over patches of variable-resolution images and video frames.

    Input rows are the image processor's patches (HF Qwen2-VL layout): each row is one
    ``in_channels x temporal_patch_size x patch_size x patch_size`` patch, and the patches of one
    image come in merge-block order (``spatial_merge_size**2`` neighbouring patches in a row), so
    that the projector merges consecutive rows into one LLM token.
    """

    type: EncoderTypeName = EncoderTypeName["qwen2.5-vit"]
    num_layers: int = 2
    hidden_size: int = 64
    ffn_hidden_size: int = 128
    num_attention_heads: int = 4
    patch_size: int = 14
    temporal_patch_size: int = 2  # frames per patch (a still image is repeated to fill it); 1 for SigLIP
    in_channels: int = 3
    spatial_merge_size: int = 2  # neighbouring patches that become one LLM token (projector merges them)
    norm_epsilon: float = 1e-6
    init_method_std: float = 0.02
    # qwen2.5-vit: 2-D RoPE base; window attention (windows of window_size pixels) in every layer
    # except fullatt_block_indexes (0-based), which attend over the whole image / video frame.
    rotary_base: float = 10000.0
    window_size: int = 112
    fullatt_block_indexes: list[int] = field(default_factory=list)
    # siglip: learned positions for an image_size x image_size image (image_size // patch_size
    # patches a side, as HF); other grids use the table
    # resized bicubically (as HF's interpolate_pos_encoding), so any resolution works.
    image_size: int = 224
    # DeepStack (Qwen3-VL): 0-based encoder layers whose outputs are projected (one extra merger
    # each, in the image projector) and added to the foundation's hidden states at the image
    # tokens after its layers 0, 1, ... (in this order); empty = off.
    deepstack_visual_indexes: list[int] = field(default_factory=list)
    # Component-level overrides of the global settings (principle 4 of DESIGN.md). The encoder's
    # tensor-parallel size must divide the foundation's; null = the foundation's.
    tensor_model_parallel_size: int | None = None
    freeze: bool = False
    # Build the MLP this wide: ffn_hidden_size rounded up to a multiple of pad_ffn_to (null = the
    # type's ffn_pad; 1 = no padding). Exact: see padded_ffn_hidden_size.
    pad_ffn_to: int | None = None
    recompute: Recompute | None = None
    attention: EncoderAttention = EncoderAttention.sdpa  # core attention (see specs.vision_block_spec)
    extra: dict = field(default_factory=dict)  # passed to the encoder's TransformerConfig

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def padded_ffn_hidden_size(self) -> int:
        """The MLP width the encoder is built with. The extra fc1 rows (gate and up, weights and
        biases) and fc2 columns are zero, so the extra hidden units are act(0) * 0 = 0 (gated) or
        act(0) = 0 (GELU / SiLU, non-gated) and add nothing to the output; their gradients are
        products with those zeros, exactly 0, so Adam's moments, its update and weight decay
        keep them 0. The architecture (HF's intermediate_size, FLOPs, num_parameters) is
        ffn_hidden_size."""
        pad = self.pad_ffn_to or get_encoder_type(self.type).ffn_pad
        return -(-self.ffn_hidden_size // pad) * pad

    @property
    def patch_dim(self) -> int:
        """Width of one input row (pixel values of one patch)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    def validate(self, prefix: str = "model.image_encoder") -> None:
        t = get_encoder_type(self.type)
        for key in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "patch_size",
                    "temporal_patch_size", "in_channels", "spatial_merge_size"):  # fmt: skip
            if getattr(self, key) < 1:
                raise ValueError(f"{prefix}.{key}={getattr(self, key)} must be >= 1")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"{prefix}.hidden_size={self.hidden_size} is not divisible by "
                             f"{prefix}.num_attention_heads={self.num_attention_heads}")  # fmt: skip
        if t.rope_2d and self.head_dim % 4:
            raise ValueError(f"{prefix}: head dim {self.head_dim} must be a multiple of 4 for 2-D RoPE")
        if t.windows:
            unit = self.patch_size * self.spatial_merge_size
            if self.window_size < unit or self.window_size % unit:
                raise ValueError(f"{prefix}.window_size={self.window_size} must be a positive multiple of "
                                 f"patch_size*spatial_merge_size={unit}")  # fmt: skip
        bad = [i for i in self.fullatt_block_indexes if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"{prefix}.fullatt_block_indexes has {bad}, outside 0..{self.num_layers - 1}")
        bad = [i for i in self.deepstack_visual_indexes if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"{prefix}.deepstack_visual_indexes has {bad}, outside 0..{self.num_layers - 1}")
        if len(set(self.deepstack_visual_indexes)) != len(self.deepstack_visual_indexes):
            raise ValueError(f"{prefix}.deepstack_visual_indexes={list(self.deepstack_visual_indexes)} lists a layer twice")
        if t.learned_positions and self.image_size < self.patch_size:
            raise ValueError(
                f"{prefix}.image_size={self.image_size} is smaller than patch_size={self.patch_size}"
            )
        if self.pad_ffn_to is not None and self.pad_ffn_to < 1:
            raise ValueError(f"{prefix}.pad_ffn_to={self.pad_ffn_to} must be >= 1 (1 = no padding) or null")
        if self.tensor_model_parallel_size is not None and self.tensor_model_parallel_size < 1:
            raise ValueError(
                f"{prefix}.tensor_model_parallel_size={self.tensor_model_parallel_size} must be >= 1"
            )

    def num_parameters(self) -> int:
        """Exact parameter count of the encoder's architecture (projector not included; the zero
        MLP padding of ``padded_ffn_hidden_size`` not counted, as the vocabulary's padding)."""
        t = get_encoder_type(self.type)
        h, f = self.hidden_size, self.ffn_hidden_size
        norm = h if t.normalization == "RMSNorm" else 2 * h
        attn = h * 3 * h + 3 * h + h * h + h  # qkv and output projections, with biases
        mlp = (2 if t.gated_mlp else 1) * (h * f + f) + f * h + h
        total = self.num_layers * (attn + mlp + 2 * norm)
        total += self.patch_dim * h + (h if t.patch_bias else 0)
        if t.learned_positions:
            total += (self.image_size // self.patch_size) ** 2 * h
        if t.post_norm:
            total += norm
        return total
