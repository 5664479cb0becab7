"""Shared helpers of the VLM tests: tiny configs, building the vision components in a megatron
world, and a test-local HF -> Loong weight map for the two ViT types (loong-ckpt owns the real one)."""

from __future__ import annotations

import functools

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from loong_models import (
    FoundationConfig,
    ImageEncoderConfig,
    ImageProjectorConfig,
    build_transformer_config,
    fusion_fields,
    packed_seq_params,
)
from loong_models.image_encoder import ImageEncoder, build_encoder_transformer_config
from loong_models.image_encoder.vit import FOLLOWED_FUSIONS
from loong_models.image_projector import ImageProjector, build_projector_transformer_config


def build_vision(
    enc: ImageEncoderConfig,
    proj: ImageProjectorConfig | None = None,
    out_size: int = 48,
    *,
    backend: str = "local",
    dtype: torch.dtype = torch.float32,
):
    """Encoder (+ projector), fp32 on the CPU with the local backend by default (needs a megatron
    world)."""
    # the compiled fusions as the train app's foundation has them (the encoder follows its choice)
    fused = {k: v for k, v in fusion_fields(backend).items() if k in FOLLOWED_FUSIONS}
    base = build_transformer_config(
        FoundationConfig(),
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=backend == "local",
        **fused,
    )
    econf = build_encoder_transformer_config(enc, base, tensor_model_parallel_size=1, backend=backend)
    encoder = ImageEncoder(enc, econf, layer_backend=backend)
    if proj is None:
        return encoder, None
    m = enc.spatial_merge_size
    pconf = build_projector_transformer_config(proj, base, encoder_hidden=enc.hidden_size, merge=m,
                                               out_size=out_size, tensor_model_parallel_size=1, backend=backend)  # fmt: skip
    return encoder, ImageProjector(
        proj, pconf, encoder_hidden=enc.hidden_size, merge=m, layer_backend=backend
    )


def te_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Local-spec names -> TE-spec names: TE fuses the pre-attention / pre-MLP norms into the
    following linear (``layer_norm_weight`` / ``layer_norm_bias``)."""
    out = {}
    for name, value in state.items():
        for local, fused in (("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
                             ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_")):  # fmt: skip
            if local in name:
                name = name.replace(local, fused)
        out[name] = value
    return out


def _qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """Megatron's fused QKV layout: per head [q_h; k_h; v_h] (MHA: one query per group)."""
    parts = [t.reshape(heads, -1, *t.shape[1:]) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *q.shape[1:])


def _pad_rows(t: torch.Tensor, rows: int, dim: int = 0) -> torch.Tensor:
    """``t`` with zeros appended along ``dim`` up to ``rows`` (the encoder's MLP padding)."""
    shape = list(t.shape)
    shape[dim] = rows - t.shape[dim]
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def qwen_vit_state(
    hf: dict[str, torch.Tensor], heads: int, depth: int, padded_ffn: int | None = None
) -> dict[str, torch.Tensor]:
    """HF Qwen2_5_VisionTransformerPretrainedModel state -> {image_encoder, image_projector} states
    (the MLP zero-padded to ``padded_ffn`` units, ``ImageEncoderConfig.padded_ffn_hidden_size``)."""
    enc = {"patch_embed.proj.weight": hf["patch_embed.proj.weight"]}
    for i in range(depth):
        b, o = f"blocks.{i}.", f"decoder.layers.{i}."
        enc[o + "input_layernorm.weight"] = hf[b + "norm1.weight"]
        enc[o + "pre_mlp_layernorm.weight"] = hf[b + "norm2.weight"]
        for kind in ("weight", "bias"):
            enc[o + f"self_attention.linear_qkv.{kind}"] = _qkv(*hf[b + f"attn.qkv.{kind}"].chunk(3), heads)
            enc[o + f"self_attention.linear_proj.{kind}"] = hf[b + f"attn.proj.{kind}"]
            gate, up = hf[b + f"mlp.gate_proj.{kind}"], hf[b + f"mlp.up_proj.{kind}"]
            width = padded_ffn or gate.shape[0]
            enc[o + f"mlp.linear_fc1.{kind}"] = torch.cat([_pad_rows(gate, width), _pad_rows(up, width)])
            down = hf[b + f"mlp.down_proj.{kind}"]
            enc[o + f"mlp.linear_fc2.{kind}"] = _pad_rows(down, width, 1) if kind == "weight" else down
    proj = {"norm.weight": hf["merger.ln_q.weight"]}
    for kind in ("weight", "bias"):
        proj[f"mlp.linear_fc1.{kind}"] = hf[f"merger.mlp.0.{kind}"]
        proj[f"mlp.linear_fc2.{kind}"] = hf[f"merger.mlp.2.{kind}"]
    return {"image_encoder": enc, "image_projector": proj}


def siglip_state(hf: dict[str, torch.Tensor], heads: int, depth: int) -> dict[str, torch.Tensor]:
    """HF SiglipVisionModel state (no head) -> image_encoder state (HF 5 drops the vision_model. prefix)."""
    p = "vision_model." if any(k.startswith("vision_model.") for k in hf) else ""
    enc = {
        "patch_embed.proj.weight": hf[p + "embeddings.patch_embedding.weight"],
        "patch_embed.proj.bias": hf[p + "embeddings.patch_embedding.bias"],
        "position_embedding.weight": hf[p + "embeddings.position_embedding.weight"],
    }
    for kind in ("weight", "bias"):
        enc[f"decoder.final_layernorm.{kind}"] = hf[p + f"post_layernorm.{kind}"]
        for i in range(depth):
            b, o = f"{p}encoder.layers.{i}.", f"decoder.layers.{i}."
            enc[o + f"input_layernorm.{kind}"] = hf[b + f"layer_norm1.{kind}"]
            enc[o + f"pre_mlp_layernorm.{kind}"] = hf[b + f"layer_norm2.{kind}"]
            qkv = (hf[b + f"self_attn.{n}_proj.{kind}"] for n in "qkv")
            enc[o + f"self_attention.linear_qkv.{kind}"] = _qkv(*qkv, heads)
            enc[o + f"self_attention.linear_proj.{kind}"] = hf[b + f"self_attn.out_proj.{kind}"]
            enc[o + f"mlp.linear_fc1.{kind}"] = hf[b + f"mlp.fc1.{kind}"]
            enc[o + f"mlp.linear_fc2.{kind}"] = hf[b + f"mlp.fc2.{kind}"]
    return enc


def load_exact(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load every parameter (no missing or unexpected names; megatron's _extra_state aside)."""
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    assert not missing and not unexpected, (missing, unexpected)


def image_to_patches(img: torch.Tensor, patch: int, merge: int) -> torch.Tensor:
    """[C, H, W] -> [H/P * W/P, C*P*P] rows in the processor's merge-block order (T = 1)."""
    c, h, w = img.shape
    gh, gw = h // patch, w // patch
    x = img.reshape(c, gh // merge, merge, patch, gw // merge, merge, patch)
    return x.permute(1, 4, 2, 5, 0, 3, 6).reshape(gh * gw, c * patch * patch)


IMG, VID, VS, VE = (
    8196,
    8197,
    8194,
    8195,
)  # tiny-vlm's <|image_pad|>, <|video_pad|>, <|vision_start|>, <|vision_end|>


def vision_tokens(kind: int, grid) -> list[int]:
    t, h, w = grid
    return [VS] + [kind] * (t * h * w // 4) + [VE]


@functools.cache
def _hf_qwen2_5_vl() -> torch.nn.Module:
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    cfg = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=8198, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=16,
                           tokens_per_second=2),
        image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS, vision_end_token_id=VE,
    )  # fmt: skip
    return Qwen2_5_VLModel(cfg)


def hf_rope_index(doc: list[int], images, videos, seconds) -> torch.Tensor:
    """HF transformers' Qwen2.5-VL ``get_rope_index`` of one document (the reference for
    :func:`loong_models.mrope_positions`): ``[3, 1, len(doc)]``; grids / seconds as tensors or None."""
    ids = torch.tensor([doc])
    types = (ids == IMG).int() + 2 * (ids == VID).int()
    pos, _ = _hf_qwen2_5_vl().get_rope_index(ids, types, image_grid_thw=images, video_grid_thw=videos,
                                             second_per_grid_ts=seconds)  # fmt: skip
    return pos


def packed_batch(seed: int = 0, patch_dim: int = 1176):
    """Two documents: text + image + text + video clip + text, and plain text (``patch_dim``: the
    encoder's, 3*2*14*14 for Qwen2.5-VL, 3*2*16*16 for Qwen3-VL)."""
    g = torch.Generator().manual_seed(seed)
    image, video = (1, 4, 6), (2, 4, 4)
    doc1 = [5, 6] + vision_tokens(IMG, image) + [7, 8] + vision_tokens(VID, video) + [9]
    doc2 = [3, 4, 5, 6, 7]
    tokens = torch.tensor([doc1 + doc2])
    cu = torch.tensor([0, len(doc1), len(doc1) + len(doc2)], dtype=torch.int32)
    return dict(
        input_ids=tokens, position_ids=None, attention_mask=None,
        labels=torch.randint(0, 8192, tokens.shape, generator=g),
        packed_seq_params=packed_seq_params(cu, len(doc1)),
        pixel_values=torch.randn(24, patch_dim, generator=g), image_grid_thw=torch.tensor([image]),
        pixel_values_videos=torch.randn(32, patch_dim, generator=g), video_grid_thw=torch.tensor([video]),
    )  # fmt: skip


class AtenOpCounter(TorchDispatchMode):
    """Counts the aten ops run inside it (``calls``; the ops a profiler lists): host bookkeeping
    whose op count grows with a micro-batch's images or text tokens shows up as a count that grows."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))
