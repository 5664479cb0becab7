"""The image encoder: a ViT on megatron-core's TransformerBlock over packed (THD) patches.

One forward takes every image and video clip of a micro-batch at once, as the image processor
lays them out (``pixel_values [N, C*T*P*P]`` + ``grid_thw [n, 3]``). Attention runs per image
frame (and per window in Qwen2.5-VL's window layers) as segments of one packed sequence, so no
padding and no [N, N] mask exist; the layer implementations come from specs.py.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig

from loong_models.host import to_device
from loong_models.image_encoder.config import EncoderType, ImageEncoderConfig, get_encoder_type
from loong_models.image_encoder.grid import frame_cu_seqlens, num_patches, patch_coordinates, window_partition
from loong_models.image_encoder.layers import VisionPackedSeqParams
from loong_models.packed_seq import HostPackedSeqParams
from loong_models.specs import fusion_fields, vision_block_spec

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": partial(F.gelu, approximate="tanh")}

# TransformerConfig fields a component takes over from the foundation's (what the runtime decided:
# precision, initialisation); layout fields (TP size, sequence parallel, PP) are the component's own.
RUNTIME_FIELDS = ("params_dtype", "pipeline_dtype", "bf16", "fp16", "use_cpu_initialization",
                  "perform_initialization", "deterministic_mode", "calculate_per_token_loss")  # fmt: skip
# megatron's torch.compile'd fusions, and TE's op-fuser MLP (model.fused_mlp): the foundation's choice
FOLLOWED_FUSIONS = ("bias_dropout_fusion", "bias_activation_fusion", "use_transformer_engine_op_fuser")


def runtime_fields(
    base: TransformerConfig, *, tensor_model_parallel_size: int, backend: str
) -> dict[str, Any]:
    """The component's share of the runtime settings: the foundation's precision and init, its own
    TP size, no sequence or pipeline parallelism (the encoder lives on the first stage), and the
    backend's fusions without RoPE fusion (TE's THD RoPE kernel restarts positions per segment,
    while 2-D / multimodal positions are given per token) and without the compiled elementwise
    fusions the foundation runs without (``model.fuse_bias_dropout_add`` / ``fuse_bias_activation``
    switch both); TE's op-fuser MLP where the foundation has it (``model.fused_mlp``) and the
    encoder runs at the foundation's TP size: megatron's TEFusedMLP takes its TP group from the
    global parallel state, not from the module."""
    fields = {k: getattr(base, k) for k in RUNTIME_FIELDS}
    fields.update(fusion_fields(backend, fused_mlp=True), apply_rope_fusion=False)
    for key in FOLLOWED_FUSIONS:  # each on only where the backend has it and the foundation chose it
        fields[key] = fields[key] and getattr(base, key)
    own_tp = tensor_model_parallel_size != base.tensor_model_parallel_size
    fields["use_transformer_engine_op_fuser"] = fields["use_transformer_engine_op_fuser"] and not own_tp
    fields.update(tensor_model_parallel_size=tensor_model_parallel_size, pipeline_model_parallel_size=1,
                  sequence_parallel=False)  # fmt: skip
    return fields


def recompute_fields(recompute: str | None) -> dict[str, Any]:
    if recompute is None:
        return {}
    if recompute == "full":
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return dict(recompute_granularity=recompute)


def build_encoder_transformer_config(
    cfg: ImageEncoderConfig, base: TransformerConfig, *, tensor_model_parallel_size: int, backend: str
) -> TransformerConfig:
    """The encoder's own TransformerConfig: its architecture + the foundation's runtime fields."""
    cfg.validate()
    t = get_encoder_type(cfg.type)
    fields = dict(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.padded_ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        normalization=t.normalization,
        layernorm_epsilon=cfg.norm_epsilon,
        gated_linear_unit=t.gated_mlp,
        activation_func=ACTIVATIONS[t.activation],
        add_bias_linear=True,
        add_qkv_bias=True,
        init_method_std=cfg.init_method_std,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **recompute_fields(cfg.recompute),
    )
    fields.update(
        runtime_fields(base, tensor_model_parallel_size=tensor_model_parallel_size, backend=backend)
    )
    # megatron's fused bias-GELU is the tanh approximation: fuse SwiGLU only.
    fields["bias_activation_fusion"] = (
        fields["bias_activation_fusion"] and t.gated_mlp and t.activation == "silu"
    )
    return TransformerConfig(**{**fields, **cfg.extra})


def _thd_fields(cu: torch.Tensor, longest: int, device: torch.device) -> dict[str, Any]:
    """THD fields of segments given by host boundaries ``cu``: the boundaries on the device and,
    for attention that splits by segment (SDPA), on the host (``bounds``)."""
    on_device = to_device(cu, device)
    return dict(qkv_format="thd", cu_seqlens_q=on_device, cu_seqlens_kv=on_device, max_seqlen_q=longest,
                max_seqlen_kv=longest, bounds=tuple(cu.tolist()))  # fmt: skip


def _tp_rank(pg_collection: ProcessGroupCollection | None, config: TransformerConfig) -> int:
    if config.tensor_model_parallel_size == 1:
        return 0
    group = (
        pg_collection.tp if pg_collection is not None else parallel_state.get_tensor_model_parallel_group()
    )
    return torch.distributed.get_rank(group)


@torch.no_grad()
def zero_ffn_padding(decoder: TransformerBlock, cfg: ImageEncoderConfig, gated: bool, tp_rank: int) -> None:
    """Zero the MLP units past ``cfg.ffn_hidden_size`` (see ``padded_ffn_hidden_size``): this
    rank's fc1 rows (of the gate and of the up half) and fc2 columns that lie in the padding."""
    real, padded = cfg.ffn_hidden_size, cfg.padded_ffn_hidden_size
    if real == padded:
        return
    for layer in decoder.layers:
        fc1, fc2 = layer.mlp.linear_fc1, layer.mlp.linear_fc2
        per = fc2.weight.shape[1]  # this rank's share of the padded width
        keep = min(per, max(0, real - tp_rank * per))
        for p in (fc1.weight, getattr(fc1, "bias", None)):
            if p is not None and p.numel():
                p.view(2 if gated else 1, per, *p.shape[1:])[:, keep:].zero_()
        fc2.weight[:, keep:].zero_()


class PatchEmbed(torch.nn.Module):
    """Linear embedding of flattened patches, stored as the convolution it equals (kernel = stride
    = patch): ``proj`` is a Conv3d ``[D, C, T, P, P]`` (Qwen2.5-VL, temporal patches for video) or
    a Conv2d ``[D, C, P, P]`` (SigLIP), so HF weights map by name. Computed as one matmul."""

    def __init__(self, cfg: ImageEncoderConfig, t: EncoderType, config: TransformerConfig) -> None:
        super().__init__()
        c, p, d = cfg.in_channels, cfg.patch_size, cfg.hidden_size
        kw = dict(bias=t.patch_bias, dtype=config.params_dtype)
        if t.rope_2d:
            k = (cfg.temporal_patch_size, p, p)
            self.proj = torch.nn.Conv3d(c, d, kernel_size=k, stride=k, **kw)
        else:
            if cfg.temporal_patch_size != 1:
                raise ValueError(f"model.image_encoder.temporal_patch_size={cfg.temporal_patch_size}: "
                                 f"type {t.name!r} embeds single frames; set it to 1")  # fmt: skip
            self.proj = torch.nn.Conv2d(c, d, kernel_size=p, stride=p, **kw)
        if config.perform_initialization:
            config.init_method(self.proj.weight)
            if self.proj.bias is not None:
                torch.nn.init.zeros_(self.proj.bias)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return F.linear(pixel_values.to(w.dtype), w.flatten(1), self.proj.bias)


class ImageEncoder(MegatronModule):
    """``forward(pixel_values, grid_thw) -> [N, hidden]`` patch features in input order.

    Modules: ``patch_embed.proj``, ``position_embedding`` (learned-position types only),
    ``decoder`` (megatron TransformerBlock; ``decoder.final_layernorm`` for post-norm types).
    """

    def __init__(
        self,
        cfg: ImageEncoderConfig,
        config: TransformerConfig,
        *,
        layer_backend: str,
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        super().__init__(config=config)
        cfg.validate()
        self.cfg = cfg
        self.encoder_type = t = get_encoder_type(cfg.type)
        self.patch_embed = PatchEmbed(cfg, t, config)
        if t.learned_positions:
            side = cfg.image_size // cfg.patch_size
            self.position_embedding = torch.nn.Embedding(
                side * side, cfg.hidden_size, dtype=config.params_dtype
            )
            if config.perform_initialization:
                config.init_method(self.position_embedding.weight)
        window_layers = (
            frozenset(range(cfg.num_layers)) - set(cfg.fullatt_block_indexes) if t.windows else frozenset()
        )
        self.window_layers = window_layers
        spec = vision_block_spec(config, backend=layer_backend, window_layers=window_layers, attention=cfg.attention)
        self.decoder = TransformerBlock(
            config=config, spec=spec, post_layer_norm=t.post_norm, pre_process=True, post_process=True,
            pg_collection=pg_collection,
        )  # fmt: skip
        zero_ffn_padding(self.decoder, cfg, t.gated_mlp, _tp_rank(pg_collection, config))
        if t.rope_2d:
            # half the head dim rotates with the row, half with the column (HF's axial 2-D RoPE)
            quarter = cfg.head_dim // 2
            inv = 1.0 / (cfg.rotary_base ** (torch.arange(0, quarter, 2, dtype=torch.float32) / quarter))
            self.register_buffer("inv_freq", inv, persistent=False)

    def set_input_tensor(self, input_tensor) -> None:  # the encoder never sits on a later PP stage
        pass

    def _learned_positions(
        self, grid_thw: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor
    ) -> torch.Tensor:
        side = self.cfg.image_size // self.cfg.patch_size
        table = self.position_embedding.weight.view(side, side, -1)
        out, start, resized = [], 0, {}
        for t, h, w in grid_thw.tolist():
            n = t * h * w
            if (h, w) not in resized:
                if (h, w) == (side, side):
                    resized[h, w] = table
                else:  # SigLIP: HF's interpolate_pos_encoding; Qwen3-VL: bilinear, corners aligned
                    corners = self.encoder_type.position_interpolation == "bilinear_corners"
                    grid = F.interpolate(table.permute(2, 0, 1)[None], size=(h, w),
                                         mode="bilinear" if corners else "bicubic", align_corners=corners)  # fmt: skip
                    resized[h, w] = grid[0].permute(1, 2, 0)
            out.append(resized[h, w][rows[start : start + n], cols[start : start + n]])
            start += n
        return torch.cat(out)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        return self.encode(pixel_values, grid_thw)[0]

    def encode(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``(features [N, hidden], deepstack)``: the last layer's patch features and, for each of
        ``deepstack_visual_indexes``, that layer's output (both in input order)."""
        cfg, t = self.cfg, self.encoder_type
        grid_thw = grid_thw.cpu()  # host bookkeeping (no-op for the grids the forward step keeps there)
        n = num_patches(grid_thw)
        if pixel_values.dim() != 2 or pixel_values.shape != (n, cfg.patch_dim):
            raise ValueError(f"pixel_values has shape {tuple(pixel_values.shape)}; grid_thw {grid_thw.tolist()} "
                             f"needs [{n}, {cfg.patch_dim}] (patches x in_channels*temporal_patch*patch^2)")  # fmt: skip
        dev, m = pixel_values.device, cfg.spatial_merge_size
        x = self.patch_embed(pixel_values)
        rows, cols = patch_coordinates(grid_thw, m, dev)
        if t.learned_positions:
            x = x + self._learned_positions(grid_thw, rows, cols).to(x.dtype)
        cu, longest = frame_cu_seqlens(grid_thw)  # on the host, and copied to the device
        params = VisionPackedSeqParams(**_thd_fields(cu, longest, dev))
        rope = None
        if t.rope_2d:
            freqs = torch.cat([rows[:, None] * self.inv_freq, cols[:, None] * self.inv_freq], dim=-1)
            rope = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]  # [N, 1, 1, head_dim]
        order = None
        if self.window_layers:
            blocks, cu_w, longest_w = window_partition(grid_thw, m, cfg.window_size // (m * cfg.patch_size))
            blocks = to_device(blocks, dev)
            unit = m * m
            order = (blocks[:, None] * unit + torch.arange(unit, device=dev)).reshape(-1)
            x = x[order]
            rope = rope[order] if rope is not None else None
            params.window = HostPackedSeqParams(**_thd_fields(cu_w, longest_w, dev))
        taps = cfg.deepstack_visual_indexes
        out = self.decoder(x[:, None], attention_mask=None, rotary_pos_emb=rope, packed_seq_params=params,
                           extract_layer_indices=set(taps))  # fmt: skip
        h, found = out if taps else (out, [])
        # megatron returns the taps in layer order; deepstack_visual_indexes may list them in any
        found = dict(zip(sorted(set(taps)), found))
        feats = [h[:, 0]] + [found[i][:, 0] for i in taps]
        if order is not None:  # back to input order: the projector merges consecutive patches
            feats = [torch.empty_like(f).index_copy_(0, order, f) for f in feats]
        return feats[0], feats[1:]
