"""The Wan 2.x DiT as a megatron-core module: patchify -> layers -> modulated head -> unpatchify.

``forward(latents [b, c, f, h, w], timestep [b] or [b, tokens], context [b, text_len, text_dim],
image [b, image_len, image_dim] | None) -> [b, out_channels, f, h, w]`` (the flow's velocity).
All samples of a micro-batch share one latent shape (batch by resolution).

Sequence parallelism (``sequence_parallel`` with TP > 1, megatron's): the video tokens are split
over the TP ranks between the layers' parallel linears (each rank normalises, modulates and adds
residuals for its part of the sequence; the column linears all-gather it, the row linears
reduce-scatter); the text, image and timestep paths stay whole (a few hundred tokens).
Replicated parameters that see only a part of the sequence (modulation tables, the cross-attention
LayerNorm, the head) are marked ``sequence_parallel`` so that megatron sums their grads over TP.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as mpu
from megatron.core.enums import ModelType
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from loong_models.diffusion.config import WanConfig
from loong_models.diffusion.embeddings import rope_3d, timestep_features
from loong_models.diffusion.layers import WanDecoder, _linear, layer_norm
from loong_models.specs import dit_modules, fusion_fields

# What a component takes over from the runtime's TransformerConfig (precision, initialisation).
RUNTIME_FIELDS = ("params_dtype", "pipeline_dtype", "bf16", "fp16", "use_cpu_initialization",
                  "perform_initialization", "deterministic_mode", "calculate_per_token_loss")  # fmt: skip


def build_wan_transformer_config(
    cfg: WanConfig, base: TransformerConfig, *, tensor_model_parallel_size: int, backend: str
) -> TransformerConfig:
    """Wan's own TransformerConfig: its sizes + the runtime's precision and init, its TP size."""
    cfg.validate()
    fields: dict[str, Any] = {k: getattr(base, k) for k in RUNTIME_FIELDS}
    fields.update(fusion_fields(backend), apply_rope_fusion=False, bias_activation_fusion=False)
    fields.update(
        num_layers=cfg.num_layers, hidden_size=cfg.dim, ffn_hidden_size=cfg.ffn_dim,
        num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_attention_heads,
        kv_channels=cfg.attention_head_dim, layernorm_epsilon=cfg.eps, add_bias_linear=True,
        init_method_std=cfg.init_method_std, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tensor_model_parallel_size, pipeline_model_parallel_size=1,
        sequence_parallel=base.sequence_parallel and tensor_model_parallel_size > 1,
    )  # fmt: skip
    return TransformerConfig(**{**fields, **cfg.extra})


class _TwoLayerMLP(MegatronModule):
    """Column-parallel linear, activation, row-parallel linear (text / CLIP-image projections)."""

    def __init__(self, i: int, o: int, config: TransformerConfig, mods, act) -> None:
        super().__init__(config=config)
        self.linear_fc1 = _linear(mods.column_linear, i, o if act != "gelu" else i, config, column=True, name="fc1")
        self.linear_fc2 = _linear(mods.row_linear, o if act != "gelu" else i, o, config, column=False, name="fc2")
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear_fc1(x)[0]
        h = F.gelu(h, approximate="tanh") if self.act == "gelu_tanh" else F.gelu(h)
        return self.linear_fc2(h)[0]


class WanModel(MegatronModule):
    """Modules (checkpoint keys): ``patch_embedding`` (Conv3d), ``time_embedding.linear_1/2``,
    ``time_projection``, ``text_embedding.linear_fc1/2``, ``image_embedding`` (I2V),
    ``decoder.layers.<i>.*``, ``head.modulation``, ``head.linear``."""

    def __init__(self, cfg: WanConfig, config: TransformerConfig, *, layer_backend: str) -> None:
        super().__init__(config=config)
        cfg.validate()
        self.cfg = cfg
        self.model_type = ModelType.encoder_or_decoder  # megatron's schedules ask
        mods = dit_modules(layer_backend)
        d, dt = cfg.dim, config.params_dtype
        self.sp = config.sequence_parallel
        whole = dataclasses.replace(config, sequence_parallel=False) if self.sp else config  # text / time paths
        self.patch_embedding = torch.nn.Conv3d(cfg.in_channels, d, cfg.patch_size, cfg.patch_size, dtype=dt)
        self.time_embedding = torch.nn.ModuleDict({
            "linear_1": torch.nn.Linear(cfg.freq_dim, d, dtype=dt), "linear_2": torch.nn.Linear(d, d, dtype=dt)})  # fmt: skip
        # gathers its output (every rank modulates with all 6 vectors): megatron's local column
        # linear on every backend, as TE's refuses gather_output (a tiny GEMM on a few timesteps)
        local_column = dit_modules("local").column_linear
        self.time_projection = _linear(local_column, d, 6 * d, whole, column=True, name="tproj", gather_output=True)
        self.text_embedding = _TwoLayerMLP(cfg.text_dim, d, whole, mods, "gelu_tanh")
        if cfg.image_dim is not None:
            self.image_norm1 = torch.nn.LayerNorm(cfg.image_dim, dtype=dt)
            self.image_embedding = _TwoLayerMLP(cfg.image_dim, d, whole, mods, "gelu")
            self.image_norm2 = torch.nn.LayerNorm(d, dtype=dt)
        self.decoder = WanDecoder(cfg, config, mods, whole)
        self.head = torch.nn.Module()
        self.head.modulation = torch.nn.Parameter(torch.randn(1, 2, d, dtype=dt) / d**0.5)
        self.head.linear = torch.nn.Linear(d, cfg.out_channels * cfg.patch_volume, dtype=dt)
        if config.perform_initialization:
            for lin in (self.time_embedding["linear_1"], self.time_embedding["linear_2"], self.head.linear):
                config.init_method(lin.weight)
                torch.nn.init.zeros_(lin.bias)
        if self.sp:
            for p in (self.head.modulation, *self.head.linear.parameters()):
                p.sequence_parallel = True

    def set_input_tensor(self, input_tensor) -> None:  # one pipeline stage: nothing comes in
        pass

    def grid(self, latents: torch.Tensor) -> tuple[int, int, int]:
        (pf, ph, pw), (_, c, f, h, w) = self.cfg.patch_size, latents.shape
        if c != self.cfg.in_channels or f % pf or h % ph or w % pw:
            raise ValueError(f"latents of shape {tuple(latents.shape)}: expected {self.cfg.in_channels} channels "
                             f"and frames/height/width divisible by patch_size {list(self.cfg.patch_size)}")  # fmt: skip
        return f // pf, h // ph, w // pw

    def embed_time(self, timestep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(temb [b, (tokens,) d], its 6-way modulation [.., 6, d]), both fp32."""
        e = timestep_features(timestep, self.cfg.freq_dim).to(self.time_embedding["linear_1"].weight.dtype)
        e = self.time_embedding["linear_2"](F.silu(self.time_embedding["linear_1"](e)))
        proj = self.time_projection(F.silu(e))[0]
        return e.float(), proj.float().unflatten(-1, (6, self.cfg.dim))

    def forward(self, latents, timestep, context, image=None) -> torch.Tensor:
        cfg = self.cfg
        grid = self.grid(latents)
        b = latents.shape[0]
        x = self.patch_embedding(latents).flatten(2).permute(2, 0, 1)  # [s, b, d]
        temb, tmod = self.embed_time(timestep)
        # per sample [b, d] -> [1, b, ...]; per token (Wan2.2 TI2V) [b, s, d] -> [s, b, ...]
        temb, tmod = (temb[None], tmod[None]) if timestep.dim() == 1 else (temb.transpose(0, 1), tmod.transpose(0, 1))
        if self.sp:
            x, temb, tmod = self._split_sequence(x, temb, tmod)
        ctx = self.text_embedding(context.transpose(0, 1).to(x.dtype))
        img = None
        if image is not None:
            img = self.image_embedding(layer_norm(image.transpose(0, 1), 1e-5, self.image_norm1).to(x.dtype))
            img = layer_norm(img, 1e-5, self.image_norm2).to(x.dtype)
        rope = rope_3d(grid, cfg.rope_split, cfg.rope_theta, x.device)
        x = self.decoder(x, ctx, tmod, rope, img)
        shift, scale = (self.head.modulation.float() + temb[..., None, :]).unbind(-2)
        x = self.head.linear((layer_norm(x, cfg.eps) * (1 + scale) + shift).to(x.dtype))
        if self.sp:  # the loss is computed whole on every rank: the backward just splits the grad
            x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False)
        return self._unpatchify(x, b, grid)

    def _split_sequence(self, x: torch.Tensor, temb: torch.Tensor, tmod: torch.Tensor):
        """This rank's part of the tokens (and of per-token timestep embeddings). The timestep
        embeddings are computed whole on every rank but modulate only this rank's tokens: their
        grads are summed over TP (identity forward, all-reduce backward)."""
        temb, tmod = copy_to_tensor_model_parallel_region(temb), copy_to_tensor_model_parallel_region(tmod)
        tp, rank, s = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank(), x.shape[0]
        if s % tp:
            raise ValueError(f"sequence parallelism: {s} latent tokens per sample do not split over "
                             f"{tp} tensor-parallel ranks (parallel.sequence_parallel)")  # fmt: skip
        part = lambda t: t if t.shape[0] == 1 else t[rank * (s // tp) : (rank + 1) * (s // tp)]  # noqa: E731
        return scatter_to_sequence_parallel_region(x), part(temb), part(tmod)

    def _unpatchify(self, x: torch.Tensor, b: int, grid: tuple[int, int, int]) -> torch.Tensor:
        (pf, ph, pw), (f, h, w) = self.cfg.patch_size, grid
        x = x.transpose(0, 1).reshape(b, f, h, w, pf, ph, pw, -1)
        return x.permute(0, 7, 1, 4, 2, 5, 3, 6).reshape(b, -1, f * pf, h * ph, w * pw)
