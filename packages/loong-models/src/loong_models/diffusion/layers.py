"""The blocks of the Wan DiT on megatron-core's tensor-parallel linears and core attention.

Tensors are megatron's ``[sequence, batch, hidden]``. Heads are split over tensor-parallel ranks
(column-parallel q/k/v, row-parallel output); the q/k RMSNorm normalises over ALL heads (Wan's
``rms_norm_across_heads``), so its sum of squares is all-reduced over the TP group.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from megatron.core import parallel_state as mpu
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from loong_models.diffusion.config import WanConfig
from loong_models.diffusion.pointwise import Pointwise
from loong_models.specs import DiTModules


class _AllReduceSum(torch.autograd.Function):
    """Sum over the TP group in the forward AND the backward: what follows the sum is rank-local
    (each rank's heads), so every rank's input gets the gradient of all ranks' outputs."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.clone()
        torch.distributed.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        g = g.clone()
        torch.distributed.all_reduce(g, group=ctx.group)
        return g, None


class HeadsRMSNorm(torch.nn.Module):
    """RMSNorm over all heads of a TP-split projection (``[..., local_heads * head_dim]``); the
    weight is split like the heads."""

    def __init__(self, global_size: int, config: TransformerConfig, eps: float, pw: Pointwise) -> None:
        super().__init__()
        tp = mpu.get_tensor_model_parallel_world_size()
        self.global_size, self.eps, self.tp, self.pw = global_size, eps, tp, pw
        self.weight = torch.nn.Parameter(torch.ones(global_size // tp, dtype=config.params_dtype))
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp == 1:
            return self.pw.rms_norm(x, self.weight, self.eps)
        xf = x.float()
        ss = _AllReduceSum.apply(xf.pow(2).sum(-1, keepdim=True), mpu.get_tensor_model_parallel_group())
        y = xf * torch.rsqrt(ss / self.global_size + self.eps)
        return (y * self.weight.float()).to(x.dtype)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0}, sharded_offsets
        )


def _linear(cls: type, i: int, o: int, config: TransformerConfig, *, column: bool, name: str, **kw):
    common = dict(config=config, init_method=config.init_method, bias=True, skip_bias_add=False,
                  is_expert=False, tp_comm_buffer_name=name)  # fmt: skip
    if column:
        return cls(i, o, gather_output=kw.get("gather_output", False), **common)
    return cls(i, o, input_is_parallel=True, **{**common, "init_method": config.output_layer_init_method})


class WanAttention(MegatronModule):
    """Self-attention (fused per-head q/k/v, 3-D RoPE) or cross-attention to the text (plus the
    CLIP image tokens of Wan2.1 I2V, attended separately and summed, as Wan does)."""

    def __init__(self, cfg: WanConfig, config: TransformerConfig, mods: DiTModules, layer: int, *, cross: bool,
                 pw: Pointwise, whole: TransformerConfig | None = None):  # fmt: skip
        """``whole``: the config of the text / image key and value projections (their tokens are
        never split over sequence-parallel ranks); defaults to ``config``."""
        super().__init__(config=config)
        d, tp = cfg.dim, mpu.get_tensor_model_parallel_world_size()
        whole = whole or config
        if cfg.num_attention_heads % tp:
            raise ValueError(f"model.diffusion.num_attention_heads={cfg.num_attention_heads} is not divisible "
                             f"by the tensor-parallel size {tp}")  # fmt: skip
        self.cross, self.heads, self.head_dim = cross, cfg.num_attention_heads // tp, cfg.attention_head_dim
        col = lambda o, n, c=config: _linear(mods.column_linear, d, o, c, column=True, name=n)  # noqa: E731
        if cross:
            self.linear_q, self.linear_k, self.linear_v = col(d, "q"), col(d, "k", whole), col(d, "v", whole)
        else:
            self.linear_qkv = col(3 * d, "qkv")  # per head [q; k; v] (megatron's layout, one group per head)
        self.pw = pw
        self.q_norm = HeadsRMSNorm(d, config, cfg.eps, pw)
        self.k_norm = HeadsRMSNorm(d, config, cfg.eps, pw)
        self.core_attention = self._core_attention(config, mods, layer)
        if cross and cfg.image_dim is not None:
            self.linear_k_img, self.linear_v_img = col(d, "k_img", whole), col(d, "v_img", whole)
            self.k_img_norm = HeadsRMSNorm(d, config, cfg.eps, pw)
        self.linear_proj = _linear(mods.row_linear, d, d, config, column=False, name="proj")

    def _core_attention(self, config: TransformerConfig, mods: DiTModules, layer: int) -> MegatronModule:
        """Bidirectional; under context parallelism self-attention runs over the CP group, and
        cross-attention (to the whole text, on every CP rank) stays local."""
        kw = {}
        if self.cross:
            config = dataclasses.replace(config, context_parallel_size=1) if config.context_parallel_size > 1 else config
        elif config.context_parallel_size > 1:
            kw["cp_comm_type"] = config.cp_comm_type
        kind = "cross" if self.cross else "self"
        return mods.core_attention(config=config, layer_number=layer, attn_mask_type=AttnMaskType.no_mask,
                                   attention_type=kind, **kw)  # fmt: skip

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.heads, self.head_dim))

    def qkv(self, x, context=None, rope=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values [s, b, heads, head_dim]: projected, RMS-normed, RoPE-rotated."""
        if self.cross:
            q, k, v = self.linear_q(x)[0], self.linear_k(context)[0], self.linear_v(context)[0]
        else:
            qkv = self.linear_qkv(x)[0].unflatten(-1, (self.heads, 3, self.head_dim))
            q, k, v = (t.flatten(-2) for t in qkv.unbind(-2))
        q, k, v = self._heads(self.q_norm(q)), self._heads(self.k_norm(k)), self._heads(v)
        if rope is not None:
            q, k = self.pw.rope(q, *rope), self.pw.rope(k, *rope)
        return q, k, v

    def attend(self, q, k, v) -> torch.Tensor:
        return self.core_attention(q, k, v, attention_mask=None, attn_mask_type=AttnMaskType.no_mask)

    def forward(self, x, context=None, rope=None, image=None) -> torch.Tensor:
        q, k, v = self.qkv(x, context, rope)
        out = self.attend(q, k, v)
        if image is not None:
            ki = self._heads(self.k_img_norm(self.linear_k_img(image)[0]))
            out = out + self.attend(q, ki, self._heads(self.linear_v_img(image)[0]))
        return self.linear_proj(out)[0]


class WanMLP(MegatronModule):
    def __init__(self, cfg: WanConfig, config: TransformerConfig, mods: DiTModules) -> None:
        super().__init__(config=config)
        self.linear_fc1 = _linear(mods.column_linear, cfg.dim, cfg.ffn_dim, config, column=True, name="fc1")
        self.linear_fc2 = _linear(mods.row_linear, cfg.ffn_dim, cfg.dim, config, column=False, name="fc2")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x)[0], approximate="tanh"))[0]


def layer_norm(x: torch.Tensor, eps: float, norm: torch.nn.LayerNorm | None = None) -> torch.Tensor:
    """LayerNorm in fp32 (Wan's FP32LayerNorm), affine when ``norm`` is given."""
    w, b = (norm.weight.float(), norm.bias.float()) if norm is not None else (None, None)
    return F.layer_norm(x.float(), (x.shape[-1],), w, b, eps)


def recompute(fn, *args):
    """``fn(*args)``, its activations recomputed in the backward (torch's non-reentrant
    checkpoint: the recompute runs inside the backward that needs it, under the same device
    context, and nests with the layers' communication)."""
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)


class WanLayer(MegatronModule):
    """One Wan block: modulated self-attention, cross-attention, modulated FFN, each a gated
    (or plain, for cross-attention) residual. ``modulation`` is the learned [1, 6, dim] table
    added to the timestep projection (shift, scale, gate for attention; the same for the FFN)."""

    def __init__(self, cfg: WanConfig, config: TransformerConfig, mods: DiTModules, layer: int, pw: Pointwise,
                 whole: TransformerConfig | None = None) -> None:  # fmt: skip
        super().__init__(config=config)
        self.eps, self.pw = cfg.eps, pw
        self.self_attention = WanAttention(cfg, config, mods, layer, cross=False, pw=pw)
        self.cross_attention = WanAttention(cfg, config, mods, layer, cross=True, pw=pw, whole=whole)
        self.cross_norm = (
            torch.nn.LayerNorm(cfg.dim, eps=cfg.eps, dtype=config.params_dtype) if cfg.cross_attn_norm else None
        )
        self.mlp = WanMLP(cfg, config, mods)
        self.recompute = None  # set by WanDecoder: None, "full" or "keep_attention"
        self.modulation = torch.nn.Parameter(torch.randn(1, 6, cfg.dim, dtype=config.params_dtype) / cfg.dim**0.5)
        # replicated, applied to this rank's part of the sequence: megatron sums their grads over TP
        for p in (self.modulation, *(self.cross_norm.parameters() if self.cross_norm is not None else ())):
            p.sequence_parallel = config.sequence_parallel

    def forward(self, x, context, temb, cos, sin, image=None) -> torch.Tensor:
        """x [s, b, d]; temb [s or 1, b, 6, d] (fp32); cos, sin: RoPE; context [t, b, d].
        With ``recompute=keep_attention`` (training) the parts before and after the self-attention
        kernel are recomputed in the backward; the kernel's inputs and output are kept."""
        if self.recompute == "keep_attention" and self.training:
            q, k, v = recompute(self._self_qkv, x, temb, cos, sin)
            attn = self.self_attention.attend(q, k, v)
            return recompute(self._after_attention, x, attn, context, temb, image)
        q, k, v = self._self_qkv(x, temb, cos, sin)
        return self._after_attention(x, self.self_attention.attend(q, k, v), context, temb, image)

    def _modulation(self, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """shift, scale, gate (self-attention), then the same for the FFN."""
        return (self.modulation.float() + temb).unbind(-2)

    def _self_qkv(self, x, temb, cos, sin):
        shift, scale = self._modulation(temb)[:2]
        return self.self_attention.qkv(self.pw.modulate(x, self.eps, scale, shift), rope=(cos, sin))

    def _after_attention(self, x, attn, context, temb, image) -> torch.Tensor:
        _, _, gate, c_shift, c_scale, c_gate = self._modulation(temb)
        x = self.pw.gated_residual(x, self.self_attention.linear_proj(attn)[0], gate)
        n = self.cross_norm
        h = self.pw.affine_norm(x, self.eps, n.weight, n.bias) if n is not None else x
        x = x + self.cross_attention(h, context=context, image=image)
        return self.pw.gated_residual(x, self.mlp(self.pw.modulate(x, self.eps, c_scale, c_shift)), c_gate)


class WanDecoder(MegatronModule):
    """The stack of layers, ``layers.<i>`` in checkpoints (indexed keys); the first
    ``recompute_num_layers`` (all by default) recompute in the backward as ``recompute`` says."""

    def __init__(self, cfg: WanConfig, config: TransformerConfig, mods: DiTModules, pw: Pointwise,
                 whole: TransformerConfig | None = None) -> None:  # fmt: skip
        super().__init__(config=config)
        self.layers = torch.nn.ModuleList(WanLayer(cfg, config, mods, i + 1, pw, whole) for i in range(cfg.num_layers))
        n = cfg.num_layers if cfg.recompute_num_layers is None else cfg.recompute_num_layers
        for layer in self.layers[:n]:
            layer.recompute = cfg.recompute

    def forward(self, x, context, temb, rope, image=None) -> torch.Tensor:
        for layer in self.layers:
            if layer.recompute == "full" and self.training:
                x = recompute(layer, x, context, temb, *rope, image)
            else:
                x = layer(x, context, temb, *rope, image)
        return x

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        out = {}
        for i, layer in enumerate(self.layers):
            out.update(layer.sharded_state_dict(f"{prefix}layers.{i}.", sharded_offsets, metadata))
        return out
