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

Context parallelism (``parallel.cp``): after the patch embedding each CP rank keeps its contiguous
``1/cp`` of the video tokens (:mod:`loong_models.diffusion.tokens`), with their 3-D RoPE angles and
(per-token timesteps) their modulation; self-attention runs over the CP group (ring or
all-to-all: TE's, or loong-models' on the local backend), cross-attention to the whole text stays
local. The output is then this rank's part of the patch tokens, ``[b, tokens / cp, pf*ph*pw*c]``:
the loss is computed on it and summed over the CP ranks (megatron reduces gradients and sample
counts over DP x CP), so no rank ever holds the whole video's activations.
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
from loong_models.diffusion.pointwise import Pointwise
from loong_models.diffusion.tokens import context_parallel_part, unpatchify
from loong_models.specs import dit_modules, fusion_fields

# What a component takes over from the runtime's TransformerConfig (precision, initialisation).
RUNTIME_FIELDS = ("params_dtype", "pipeline_dtype", "bf16", "fp16", "use_cpu_initialization",
                  "perform_initialization", "deterministic_mode", "calculate_per_token_loss",
                  "context_parallel_size", "cp_comm_type")  # fmt: skip


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
        self.sp, self.cp = config.sequence_parallel, config.context_parallel_size
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
        fuse = cfg.fuse_pointwise if cfg.fuse_pointwise is not None else layer_backend == "te"
        self.pw = Pointwise.build(fuse)
        self.decoder = WanDecoder(cfg, config, mods, self.pw, whole)
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
        """The velocity ``[b, c, f, h, w]``; under context parallelism this rank's part of its
        patch tokens ``[b, tokens / cp, pf*ph*pw*c]`` (:func:`loong_models.diffusion.tokens.patch_tokens` order)."""
        cfg = self.cfg
        grid = self.grid(latents)
        x = self.patch_embedding(latents).flatten(2).permute(2, 0, 1)  # [s, b, d]
        temb, tmod = self.embed_time(timestep)
        # per sample [b, d] -> [1, b, ...]; per token (Wan2.2 TI2V) [b, s, d] -> [s, b, ...]
        temb, tmod = (temb[None], tmod[None]) if timestep.dim() == 1 else (temb.transpose(0, 1), tmod.transpose(0, 1))
        rope = rope_3d(grid, cfg.rope_split, cfg.rope_theta, x.device)
        if self.cp > 1:
            x, temb, tmod, rope = self._split_context(x, temb, tmod, rope)
        if self.sp:
            x, temb, tmod = self._split_sequence(x, temb, tmod)
        ctx = self.text_embedding(context.transpose(0, 1).to(x.dtype))
        img = None
        if image is not None:
            img = self.image_embedding(layer_norm(image.transpose(0, 1), 1e-5, self.image_norm1).to(x.dtype))
            img = layer_norm(img, 1e-5, self.image_norm2).to(x.dtype)
        x = self.decoder(x, ctx, tmod, rope, img)
        shift, scale = (self.head.modulation.float() + temb[..., None, :]).unbind(-2)
        x = self.head.linear(self.pw.modulate(x, cfg.eps, scale, shift))
        if self.sp:  # the loss is computed whole on every rank: the backward just splits the grad
            x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False)
        x = x.transpose(0, 1)
        return x if self.cp > 1 else unpatchify(x, cfg.patch_size, grid)

    def _split_context(self, x, temb, tmod, rope):
        """This CP rank's contiguous part of the tokens, of their RoPE angles and (per-token
        timesteps) of their modulation. Everything before the split is computed whole on each CP
        rank; its gradients are partial and summed over DP x CP with all the others."""
        tp = mpu.get_tensor_model_parallel_world_size() if self.sp else 1
        part = context_parallel_part(x.shape[0], self.cp, mpu.get_context_parallel_rank(), multiple=tp)
        cut = lambda t: t if t.shape[0] == 1 else t[part]  # noqa: E731
        return x[part], cut(temb), cut(tmod), tuple(r[part] for r in rope)

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
