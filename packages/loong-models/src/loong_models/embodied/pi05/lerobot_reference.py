"""LeRobot's Pi0.5 (``lerobot.policies.pi05.modeling_pi05`` + ``lerobot.policies.pi_gemma``),
transcribed for parity tests only; it needs ``transformers`` (a dev dependency).

Why a transcription: the ``lerobot`` releases that ship Pi0.5 (>= 0.4) pin ``torch < 2.12``, which
cannot install next to this workspace's torch, so the package itself cannot be the test's
reference. This file keeps LeRobot's structure, parameter names and arithmetic (commit 7427f318 of
huggingface/lerobot, Apache-2.0, Copyright 2025 Physical Intelligence and The HuggingFace Inc.
team), trimmed to the training forward: ``PiGemmaRMSNorm`` (adaRMS), ``compute_layer_complete``
(the joint layer), ``embed_prefix`` / ``embed_suffix`` and the flow-matching loss of
``PI05Pytorch.forward``, on transformers' own SigLIP, PaliGemma and Gemma modules (eager
attention, the additive OpenPI mask). Real-time chunking and memory features are left out.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GemmaConfig as HFGemmaConfig
from transformers import PaliGemmaConfig, SiglipVisionConfig
from transformers.models.gemma import modeling_gemma
from transformers.models.gemma.modeling_gemma import GemmaAttention, GemmaForCausalLM, GemmaMLP, GemmaModel
from transformers.models.paligemma.modeling_paligemma import PaliGemmaForConditionalGeneration, PaliGemmaModel

from loong_models.embodied.pi05.config import Pi05Config

OPENPI_ATTENTION_MASK_VALUE = -2.3819763e38


class PiGemmaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, cond_dim: int | None = None):
        super().__init__()
        self.eps, self.dim, self.cond_dim = eps, dim, cond_dim
        if cond_dim is not None:
            self.dense = nn.Linear(cond_dim, dim * 3, bias=True)
            nn.init.zeros_(self.dense.weight)
        else:
            self.weight = nn.Parameter(torch.zeros(dim))
            self.dense = None

    def forward(self, x, cond=None):
        var = torch.mean(torch.square(x.float()), dim=-1, keepdim=True)
        normed = x * torch.rsqrt(var + self.eps)
        if cond is None or self.dense is None:
            return (normed * (1.0 + self.weight.float())).type_as(x), None
        modulation = self.dense(cond)
        if x.ndim == 3 and modulation.ndim == 2:
            modulation = modulation.unsqueeze(1)
        scale, shift, gate = modulation.chunk(3, dim=-1)
        normed = normed * (1 + scale.float()) + shift.float()
        return normed.to(x.dtype), gate.to(x.dtype)


def _gated_residual(x, y, gate):
    return x + y if gate is None else x + y * gate


class PiGemmaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.self_attn = GemmaAttention(config=config, layer_idx=layer_idx)
        self.mlp = GemmaMLP(config)
        cond_dim = config.adarms_cond_dim if getattr(config, "use_adarms", False) else None
        self.input_layernorm = PiGemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps, cond_dim=cond_dim)
        self.post_attention_layernorm = PiGemmaRMSNorm(
            config.hidden_size, eps=config.rms_norm_eps, cond_dim=cond_dim
        )


class PiGemmaModel(GemmaModel):
    def __init__(self, config):
        super().__init__(config)
        del self.layers
        del self.norm
        cond_dim = getattr(config, "adarms_cond_dim", None)
        self.layers = nn.ModuleList(PiGemmaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = PiGemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps, cond_dim=cond_dim)


class PiGemmaForCausalLM(GemmaForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        del self.model
        self.model = PiGemmaModel(config)


class PaliGemmaModelWithPiGemma(PaliGemmaModel):
    def __init__(self, config):
        super().__init__(config)
        del self.language_model
        self.language_model = PiGemmaModel(config.text_config)


class PaliGemmaForConditionalGenerationWithPiGemma(PaliGemmaForConditionalGeneration):
    def __init__(self, config):
        super().__init__(config)
        del self.model
        self.model = PaliGemmaModelWithPiGemma(config)


def compute_layer_complete(inputs_embeds, attention_mask, position_ids, adarms_cond, layers, rotary_emb):
    query_states, key_states, value_states, gates = [], [], [], []
    for i, hidden_states in enumerate(inputs_embeds):
        layer = layers[i]
        hidden_states, gate = layer.input_layernorm(hidden_states, cond=adarms_cond[i])
        gates.append(gate)
        hidden_shape = (*hidden_states.shape[:-1], -1, layer.self_attn.head_dim)
        query_states.append(layer.self_attn.q_proj(hidden_states).view(hidden_shape).transpose(1, 2))
        key_states.append(layer.self_attn.k_proj(hidden_states).view(hidden_shape).transpose(1, 2))
        value_states.append(layer.self_attn.v_proj(hidden_states).view(hidden_shape).transpose(1, 2))
    query_states = torch.cat(query_states, dim=2)
    key_states = torch.cat(key_states, dim=2)
    value_states = torch.cat(value_states, dim=2)
    dummy = torch.zeros(query_states.shape[0], query_states.shape[2], query_states.shape[-1],
                        dtype=query_states.dtype)  # fmt: skip
    cos, sin = rotary_emb(dummy, position_ids)
    query_states, key_states = modeling_gemma.apply_rotary_pos_emb(
        query_states, key_states, cos, sin, unsqueeze_dim=1
    )
    paligemma_layer = layers[0]
    att_output, _ = modeling_gemma.eager_attention_forward(
        paligemma_layer.self_attn, query_states, key_states, value_states, attention_mask,
        paligemma_layer.self_attn.scaling,
    )  # fmt: skip
    head_dim = paligemma_layer.self_attn.head_dim
    att_output = att_output.reshape(query_states.shape[0], -1, 1 * 8 * head_dim)  # LeRobot fixes 8 heads
    outputs_embeds, start_pos = [], 0
    for i, hidden_states in enumerate(inputs_embeds):
        layer = layers[i]
        end_pos = start_pos + hidden_states.shape[1]
        out_emb = layer.self_attn.o_proj(att_output[:, start_pos:end_pos])
        out_emb = _gated_residual(hidden_states, out_emb, gates[i])
        after_first_residual = out_emb.clone()
        out_emb, gate = layer.post_attention_layernorm(out_emb, cond=adarms_cond[i])
        out_emb = layer.mlp(out_emb)
        outputs_embeds.append(_gated_residual(after_first_residual, out_emb, gate))
        start_pos = end_pos
    return outputs_embeds


def make_att_2d_masks(pad_masks, att_masks):
    cumsum = torch.cumsum(att_masks, dim=1)
    att_2d_masks = cumsum[:, None, :] <= cumsum[:, :, None]
    pad_2d_masks = pad_masks[:, None, :] * pad_masks[:, :, None]
    return att_2d_masks & pad_2d_masks


def create_sinusoidal_pos_embedding(time, dimension, min_period, max_period):
    fraction = torch.linspace(0.0, 1.0, dimension // 2, dtype=torch.float64)
    period = min_period * (max_period / min_period) ** fraction
    sin_input = time[..., None] * (1.0 / period * 2 * math.pi)
    return torch.cat([torch.sin(sin_input), torch.cos(sin_input)], dim=-1)


def _hf_configs(cfg: Pi05Config):
    v, e, s = cfg.vlm, cfg.expert, cfg.vision
    vision = SiglipVisionConfig(hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
                                num_hidden_layers=s.num_layers, num_attention_heads=s.num_attention_heads,
                                image_size=s.image_size, patch_size=s.patch_size, layer_norm_eps=s.norm_eps,
                                hidden_act="gelu_pytorch_tanh", vision_use_head=False)  # fmt: skip
    text = dict(hidden_size=v.width, intermediate_size=v.mlp_dim, num_attention_heads=v.num_heads,
                head_dim=v.head_dim, num_hidden_layers=v.depth, num_key_value_heads=v.num_kv_heads,
                hidden_activation="gelu_pytorch_tanh", vocab_size=cfg.vocab_size, rms_norm_eps=v.norm_eps,
                rope_theta=cfg.rope_theta, use_adarms=False, adarms_cond_dim=None)  # fmt: skip
    vlm = PaliGemmaConfig(vision_config=vision.to_dict(), text_config=text, projection_dim=v.width,
                          image_token_index=cfg.vocab_size, vocab_size=cfg.vocab_size)  # fmt: skip
    expert = HFGemmaConfig(head_dim=e.head_dim, hidden_size=e.width, intermediate_size=e.mlp_dim,
                           num_attention_heads=e.num_heads, num_hidden_layers=e.depth,
                           num_key_value_heads=e.num_kv_heads, vocab_size=cfg.vocab_size,
                           hidden_activation="gelu_pytorch_tanh", rms_norm_eps=e.norm_eps,
                           rope_theta=cfg.rope_theta, use_adarms=True, adarms_cond_dim=e.width)  # fmt: skip
    for c in (vlm.text_config, expert):
        c.use_adarms = c is expert
        c.adarms_cond_dim = e.width if c is expert else None
        c._attn_implementation = "eager"
    return vlm, expert


class PaliGemmaWithExpertModel(nn.Module):
    def __init__(self, cfg: Pi05Config):
        super().__init__()
        vlm, expert = _hf_configs(cfg)
        self.paligemma = PaliGemmaForConditionalGenerationWithPiGemma(config=vlm)
        self.gemma_expert = PiGemmaForCausalLM(config=expert)
        self.gemma_expert.model.embed_tokens = None


class PI05Reference(nn.Module):
    """``PI05Pytorch`` trimmed to the training forward; state dict keys as LeRobot's (without the
    ``model.`` prefix that ``PI05Policy`` adds, i.e. OpenPI's PyTorch layout)."""

    def __init__(self, cfg: Pi05Config):
        super().__init__()
        self.config = cfg
        self.paligemma_with_expert = PaliGemmaWithExpertModel(cfg)
        w = cfg.expert.width
        self.action_in_proj = nn.Linear(cfg.max_action_dim, w)
        self.action_out_proj = nn.Linear(w, cfg.max_action_dim)
        self.time_mlp_in = nn.Linear(w, w)
        self.time_mlp_out = nn.Linear(w, w)

    def embed_prefix(self, images, img_masks, tokens, masks):
        pwe = self.paligemma_with_expert
        embs, pad_masks, att_masks = [], [], []
        for img, img_mask in zip(images, img_masks, strict=True):
            img_emb = pwe.paligemma.model.get_image_features(img).pooler_output
            bsize, num_img_embs = img_emb.shape[:2]
            embs.append(img_emb)
            pad_masks.append(img_mask[:, None].expand(bsize, num_img_embs))
            att_masks += [0] * num_img_embs
        lang_emb = pwe.paligemma.model.language_model.get_input_embeddings()(tokens)
        embs.append(lang_emb)
        pad_masks.append(masks)
        att_masks += [0] * lang_emb.shape[1]
        embs, pad_masks = torch.cat(embs, dim=1), torch.cat(pad_masks, dim=1)
        att_masks = torch.tensor(att_masks, dtype=torch.bool)[None, :].expand(pad_masks.shape[0], -1)
        return embs, pad_masks, att_masks

    def embed_suffix(self, noisy_actions, timestep):
        time_emb = create_sinusoidal_pos_embedding(
            timestep, self.action_in_proj.out_features, self.config.min_period, self.config.max_period
        ).type(dtype=timestep.dtype)
        action_emb = self.action_in_proj(noisy_actions)
        time_emb = F.silu(self.time_mlp_out(F.silu(self.time_mlp_in(time_emb))))
        bsize, action_time_dim = action_emb.shape[:2]
        pad_masks = torch.ones(bsize, action_time_dim, dtype=torch.bool)
        att_masks = torch.tensor([1] + [0] * (self.config.chunk_size - 1), dtype=action_emb.dtype)
        return action_emb, pad_masks, att_masks[None, :].expand(bsize, -1), time_emb

    def velocity(self, images, img_masks, tokens, masks, x_t, time):
        prefix_embs, prefix_pad_masks, prefix_att_masks = self.embed_prefix(images, img_masks, tokens, masks)
        suffix_embs, suffix_pad_masks, suffix_att_masks, adarms_cond = self.embed_suffix(x_t, time)
        pad_masks = torch.cat([prefix_pad_masks, suffix_pad_masks], dim=1)
        att_masks = torch.cat([prefix_att_masks, suffix_att_masks], dim=1)
        att_2d = make_att_2d_masks(pad_masks, att_masks)
        position_ids = torch.cumsum(pad_masks, dim=1) - 1
        mask_4d = torch.where(att_2d[:, None, :, :], 0.0, OPENPI_ATTENTION_MASK_VALUE)
        pwe = self.paligemma_with_expert
        lm = pwe.paligemma.model.language_model
        inputs_embeds, cond = [prefix_embs, suffix_embs], [None, adarms_cond]
        for layers in zip(lm.layers, pwe.gemma_expert.model.layers, strict=True):
            inputs_embeds = compute_layer_complete(
                inputs_embeds, mask_4d, position_ids, cond, layers, lm.rotary_emb
            )
        suffix_out, _ = pwe.gemma_expert.model.norm(inputs_embeds[1], adarms_cond)
        return self.action_out_proj(suffix_out[:, -self.config.chunk_size :].to(torch.float32))

    def forward(self, images, img_masks, tokens, masks, actions, noise, time):
        x_t = time[:, None, None] * noise + (1 - time[:, None, None]) * actions
        v_t = self.velocity(images, img_masks, tokens, masks, x_t, time)
        return F.mse_loss(noise - actions, v_t, reduction="none")
