"""The Pi0.5 policy: PaliGemma (SigLIP + Gemma) over images and the prompt, a Gemma action expert
over the noisy action chunk, joint attention layer by layer, a flow-matching velocity head.

A batch is a dict of tensors:
  ``images`` [B, cameras, 3, H, W] in [-1, 1], ``image_masks`` [B, cameras] (False = no camera),
  ``tokens`` / ``token_mask`` [B, L] (the prompt with the discretised state),
  ``actions`` [B, chunk_size, max_action_dim] (normalised, zero-padded), for training.
The prefix (images, prompt) attends bidirectionally within itself; the action tokens attend to
the whole prefix and to each other; the prefix never sees the actions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loong_models.embodied.pi05.config import Pi05Config
from loong_models.embodied.pi05.flow import (
    euler_sample,
    noisy_actions,
    sample_time,
    time_embedding,
    velocity_target,
)
from loong_models.embodied.pi05.layers import AdaRMSNorm, GemmaRMSNorm, JointLayer
from loong_models.embodied.pi05.siglip import SiglipTower
from loong_models.host import to_device

# the activation dtypes whose rounded embedding normaliser the policy keeps
EMBED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# model.embodied.compile_scope -> the Pi05Policy method that compiles it
COMPILERS = {"per_layer": "compile_layers", "policy": "compile_policy"}


def attention_mask(pad: torch.Tensor, block_starts: torch.Tensor) -> torch.Tensor:
    """[B, S, S] boolean: token j is visible to token i when both are real and j's block (the
    cumulative count of block starts) is not after i's (big_vision's ``mask_ar`` scheme)."""
    blocks = torch.cumsum(block_starts.to(torch.int32), dim=1)
    return (blocks[:, None, :] <= blocks[:, :, None]) & pad[:, None, :] & pad[:, :, None]


def real_dims(losses: torch.Tensor, dims: torch.Tensor) -> torch.Tensor:
    """``losses[..., dims]`` for a boolean ``dims`` mask. The batcher's masks are a prefix (the
    real dims, then padding): with the mask on the host that is a slice, whereas indexing a device
    tensor by a mask reads the selected positions back (a stream sync after the whole forward)."""
    mask = dims.bool()
    n = int(mask.sum())
    if mask.device.type == "cpu" and bool(mask[:n].all()):
        return losses[..., :n].contiguous()  # the values and layout of the masked copy
    return losses[..., mask.to(losses.device)]


class Pi05Policy(nn.Module):
    def __init__(self, cfg: Pi05Config) -> None:
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        v, e = cfg.vlm, cfg.expert
        self.vision = SiglipTower(cfg.vision)
        self.projector = nn.Linear(cfg.vision.hidden_size, v.width)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, v.width)
        self.layers = nn.ModuleList(JointLayer(v, e, cfg.attention_impl) for _ in range(v.depth))
        self.vlm_norm = GemmaRMSNorm(v.width, v.norm_eps)
        self.expert_norm = AdaRMSNorm(e.width, e.width, e.norm_eps)
        self.action_in_proj = nn.Linear(cfg.max_action_dim, e.width)
        self.action_out_proj = nn.Linear(e.width, cfg.max_action_dim)
        self.time_mlp_in = nn.Linear(e.width, e.width)
        self.time_mlp_out = nn.Linear(e.width, e.width)
        # Gemma's embedding normaliser rounded to each activation dtype (as HF Gemma), kept as Python
        # scalars (on the host, also when the policy is built on the meta device): neither a
        # host-to-device copy mid-forward nor a graph break under torch.compile
        self._embed_scale = {dt: torch.tensor(v.width**0.5, dtype=dt, device="cpu").item() for dt in EMBED_DTYPES}
        self._freeze()
        if cfg.compile_scope != "none":
            getattr(self, COMPILERS[cfg.compile_scope])(mode=cfg.compile_mode)

    def compile_layers(self, **compile_kwargs) -> None:
        """torch.compile each SigLIP layer and each joint layer in place (parameter names and the
        state dict stay as they are); the layers of a kind share one compiled graph. A parameter
        whose output is unused (the last VLM block's MLP) then gets a zero gradient, not None."""
        for layer in [*self.vision.layers, *self.layers]:
            layer.compile(**compile_kwargs)

    def compile_policy(self, **compile_kwargs) -> None:
        """torch.compile the whole training loss (compile_scope=policy): the vision tower, every
        joint layer and the flow head in one forward graph and one backward graph. Pi0.5's training
        shapes are fixed, so it compiles once; the host then launches the generated kernels instead
        of running dozens of compiled layers' wrappers (the full-shape step is host-bound). Longer to
        compile than per_layer (every layer is traced); the parameters and state dict stay as they are."""
        self.flow_loss = torch.compile(self.flow_loss, **compile_kwargs)

    def _freeze(self) -> None:
        frozen = []
        if self.cfg.freeze_vision_encoder or self.cfg.train_expert_only:
            frozen += [self.vision]
        if self.cfg.train_expert_only:
            frozen += [self.projector, self.embed_tokens, self.vlm_norm] + [
                layer.vlm for layer in self.layers
            ]
        for module in frozen:
            module.requires_grad_(False)

    # --- inputs -> token embeddings ----------------------------------------------------------
    def embed_prefix(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Image patches (per camera, projected) then prompt tokens (scaled by sqrt(width), as Gemma
        scales its embeddings); returns embeddings [B, P, W] and the real-token mask [B, P]."""
        images, image_masks = batch["images"], batch["image_masks"]
        embs, pads = [], []
        for cam in range(images.shape[1]):
            feats = self.projector(self.vision(images[:, cam]))
            embs.append(feats)
            pads.append(image_masks[:, cam : cam + 1].expand(-1, feats.shape[1]))
        tokens = self.embed_tokens(batch["tokens"])
        embs.append(tokens * self._embed_scale[tokens.dtype])
        pads.append(batch["token_mask"].bool())
        return torch.cat(embs, dim=1), torch.cat(pads, dim=1)

    def time_condition(self, time: torch.Tensor) -> torch.Tensor:
        """The adaRMS condition of the expert: an MLP of the sine-cosine time embedding."""
        emb = time_embedding(time, self.cfg.expert.width, self.cfg.min_period, self.cfg.max_period)
        return F.silu(self.time_mlp_out(F.silu(self.time_mlp_in(emb))))

    # --- training ----------------------------------------------------------------------------
    def velocity(self, batch: dict[str, torch.Tensor], x_t: torch.Tensor, time: torch.Tensor) -> torch.Tensor:
        """The predicted velocity [B, H, max_action_dim] at noisy actions ``x_t`` and time ``time``."""
        prefix, prefix_pad = self.embed_prefix(batch)
        suffix = self.action_in_proj(x_t)
        cond = self.time_condition(time)
        b, p, s = prefix.shape[0], prefix.shape[1], suffix.shape[1]
        pad = torch.cat([prefix_pad, prefix_pad.new_ones(b, s)], dim=1)
        # the action block starts after the prefix (built on the device: no host-to-device copy)
        starts = (torch.arange(p + s, device=pad.device) == p).expand(b, -1)
        mask, positions = attention_mask(pad, starts), torch.cumsum(pad, dim=1) - 1
        xs = [prefix, suffix.to(prefix.dtype)]
        for i, layer in enumerate(self.layers):  # the last layer's prefix output is never read
            xs = layer(xs, cond, mask, positions, self.cfg.rope_theta, prefix_out=i < len(self.layers) - 1)
        out, _ = self.expert_norm(xs[1], cond)
        return self.action_out_proj(out.float())

    def flow_loss(
        self, batch: dict[str, torch.Tensor], noise: torch.Tensor, time: torch.Tensor
    ) -> torch.Tensor:
        """Per-element squared error [B, H, max_action_dim] of the velocity at (noise, time)."""
        actions = batch["actions"]
        v = self.velocity(batch, noisy_actions(actions, noise, time), time)
        return F.mse_loss(v, velocity_target(actions, noise), reduction="none")

    def draw_noise_and_time(
        self, batch: dict[str, torch.Tensor], generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The flow's noise and time per sample. With ``batch["sample_ids"]`` each sample draws from
        its own generator seeded by its id, so a sample's draw does not depend on which rank or
        micro-batch holds it (DP=N reproduces DP=1); otherwise from ``generator`` (or the global RNG)."""
        actions = batch["actions"]
        shape = actions.shape[1:]
        ids = batch.get("sample_ids")
        if ids is None:
            noise = torch.randn(actions.shape, generator=generator)
            return noise.to(actions.device), sample_time(self.cfg, actions.shape[0], generator).to(
                actions.device
            )
        gens = [torch.Generator().manual_seed(int(i)) for i in ids.tolist()]
        noise = torch.stack([torch.randn(shape, generator=g) for g in gens])
        time = torch.cat([sample_time(self.cfg, 1, g) for g in gens])
        return to_device(noise, actions.device), to_device(time, actions.device)

    def forward(self, batch: dict[str, torch.Tensor], generator: torch.Generator | None = None,
                reduction: str = "mean") -> torch.Tensor | tuple[torch.Tensor, int]:  # fmt: skip
        """The training loss over the batch, the chunk and the real action dims
        (``batch["action_dim_mask"]`` [max_action_dim], all dims when absent): the mean, or with
        ``reduction="sum"`` the sum and the element count (data-parallel means weigh ranks by it)."""
        losses = self.flow_loss(batch, *self.draw_noise_and_time(batch, generator))
        dims = batch.get("action_dim_mask")
        losses = losses if dims is None else real_dims(losses, dims)
        if reduction == "sum":
            return losses.sum(), losses.numel()
        return losses.mean()

    def set_input_tensor(self, tensor) -> None:
        """megatron's pipeline hook; the policy is never cut into stages, so nothing arrives."""

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        """megatron's checkpoint view: every tensor whole and replicated over data-parallel ranks
        (the policy has no tensor or pipeline parallelism); DP rank 0 holds the main replica."""
        from megatron.core import parallel_state as mpu
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        dp = (
            mpu.get_data_parallel_rank(with_context_parallel=True)
            if mpu.model_parallel_is_initialized()
            else 0
        )
        return {
            prefix + name: ShardedTensor.from_rank_offsets(prefix + name, t, replica_id=(0, 0, dp))
            for name, t in self.state_dict(keep_vars=True).items()
        }

    # --- inference ---------------------------------------------------------------------------
    @torch.no_grad()
    def sample_actions(
        self, batch: dict[str, torch.Tensor], noise: torch.Tensor | None = None, steps: int | None = None
    ) -> torch.Tensor:
        """Euler-integrate the velocity from noise; the prefix runs once (its keys/values cached)."""
        cfg = self.cfg
        prefix, prefix_pad = self.embed_prefix(batch)
        b, p = prefix_pad.shape
        mask = attention_mask(prefix_pad, torch.zeros_like(prefix_pad))
        positions = torch.cumsum(prefix_pad, dim=1) - 1
        cache, x = [], prefix
        for layer in self.layers:
            x, kv = layer.prefix_kv(x, mask, positions, cfg.rope_theta)
            cache.append(kv)
        if noise is None:
            noise = torch.randn(b, cfg.chunk_size, cfg.max_action_dim, device=prefix.device)
        s = noise.shape[1]
        suffix_mask = torch.cat([prefix_pad[:, None, :].expand(b, s, p), prefix_pad.new_ones(b, s, s)], dim=2)
        suffix_pos = prefix_pad.sum(1, keepdim=True) + torch.arange(s, device=prefix.device)[None]

        def velocity(x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            cond = self.time_condition(t)
            h = self.action_in_proj(x_t).to(prefix.dtype)
            for layer, kv in zip(self.layers, cache):
                h = layer.suffix_with_cache(h, kv, cond, suffix_mask, suffix_pos, cfg.rope_theta)
            return self.action_out_proj(self.expert_norm(h, cond)[0].float())

        return euler_sample(velocity, noise, steps or cfg.num_inference_steps)
