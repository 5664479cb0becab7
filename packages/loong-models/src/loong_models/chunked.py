"""ChunkPipe, the model side: a GPT model that runs one long sample chunk by chunk.

:func:`enable_chunkpipe` routes every decoder layer's core attention through
:class:`ChunkedAttention` and makes the model's RoPE read the positions of the current chunk (applied from outside, like
LoRA: the layer specs stay as built). A :class:`ChunkState` holds, per layer, the keys / values of
the sample, written chunk by chunk: a chunk attends to those of earlier chunks plus its own (bottom-right
causal alignment: query ``i`` of the chunk sits at sample index ``start + i``), and backward
accumulates in a gradient buffer what later chunks send to earlier chunks' keys and values; the
schedule (loong-parallel's :mod:`loong_parallel.chunkpipe`) runs backward in reverse chunk order,
so a chunk's keys / values receive that sum within its own backward.

Memory: per layer, one ``[S, b, groups, head_dim]`` buffer each for keys, values and their two
gradients (MLA: the decompressed ``[S, b, heads, qk_head_dim + rope_dim]`` keys and
``[S, b, heads, v_head_dim]`` values), allocated once per sample; a chunk's attention reads a view of it (no concatenation,
and nothing else of the chunk, e.g. the fused QKV projection a value is a view of, stays alive).

Packed (THD) samples: a query sees a key only within its own segment (``boundaries``), and RoPE
positions restart per segment, across chunk boundaries too. Supported: rotary-embedding GQA / MHA
models (Llama, Qwen) and multi-latent attention (DeepSeek-V3 MLA: each layer's own RoPE reads
the chunk's positions, and the keys / values that reach the core attention, decompressed with
the rotary key part appended, are what is cached). DeepSeek sparse attention (DSA) is refused.
MoE layers route every token on its own, so a chunk routes as the whole sample does; the
expert-bias token counts are taken only in forwards with gradients, which every chunk runs once.
Refused, because they see a whole micro-batch: load-balancing losses, the router z-loss, token
dropping (capacity factor), and expert parallelism (DP ranks run different numbers of chunks).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from torch.nn.attention.bias import causal_lower_right


@dataclass
class _LayerCache:
    """One layer's keys and values of the whole sample (written chunk by chunk) and the
    gradient that later chunks sent to them (``[S, b, groups, head_dim]`` each)."""

    keys: torch.Tensor
    values: torch.Tensor
    key_grads: torch.Tensor
    value_grads: torch.Tensor


@dataclass
class ChunkState:
    """The sample being run: its per-token RoPE positions and segments, the current chunk, and
    per layer the key/value cache of the whole sample with its gradient accumulators."""

    num_layers: int
    positions: torch.Tensor | None = None  # [S] RoPE position of every token of the sample
    boundaries: list[int] = field(default_factory=list)  # segment (document) starts, then S
    chunk: int = 0  # index of the current chunk in the sample
    start: int = 0  # sample index of the current chunk's first token
    end: int = 0
    build_cache: bool = True  # first pass: write this chunk's keys/values into the cache
    cache: list[_LayerCache | None] = field(default_factory=list)

    def begin_sample(self, positions: torch.Tensor, boundaries: list[int]) -> None:
        self.positions, self.boundaries = positions, boundaries
        self.cache = [None] * self.num_layers

    def segments_in_chunk(self) -> list[tuple[int, int]]:
        """(segment start, end of the segment's part up to this chunk's end) for every segment
        with tokens in the current chunk, in order."""
        b = self.boundaries
        return [(lo, min(hi, self.end)) for lo, hi in zip(b[:-1], b[1:]) if lo < self.end and hi > self.start]

    def begin_chunk(self, chunk: int, start: int, end: int, *, build_cache: bool) -> None:
        self.chunk, self.start, self.end, self.build_cache = chunk, start, end, build_cache

    def layer_cache(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> _LayerCache:
        """The layer's cache, allocated on its first chunk for the sample's length (the only
        per-token memory ChunkPipe holds: keys, values and their gradients; MLA's values have
        another head size than its keys)."""
        if self.cache[layer] is None:
            rows = len(self.positions)
            k, v = ([torch.zeros((rows, *x.shape[1:]), dtype=x.dtype, device=x.device) for _ in range(2)]
                    for x in (key, value))  # fmt: skip
            self.cache[layer] = _LayerCache(keys=k[0], values=v[0], key_grads=k[1], value_grads=v[1])
        return self.cache[layer]

    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for c in self.cache if c for t in vars(c).values())

    def end_sample(self) -> None:
        self.cache, self.positions, self.boundaries = [], None, []


class _CacheWindow(torch.autograd.Function):
    """Keys (or values) ``[0, end)`` of the sample as one tensor: a view of the layer's cache,
    into which the first pass writes this chunk's rows (no concatenation, nothing copied per
    chunk). Backward splits the window's gradient: rows of earlier chunks accumulate in the
    cache's gradient buffer (their chunks run backward later, in reverse order), and this
    chunk's rows get, on top of their own, what later chunks accumulated for them."""

    @staticmethod
    def forward(ctx, live, cache, grads, start: int, end: int, write: bool):
        if write:
            cache[start:end].copy_(live)
        ctx.grads, ctx.start, ctx.end = grads, start, end
        return cache[:end]

    @staticmethod
    def backward(ctx, grad):
        acc, a, b = ctx.grads, ctx.start, ctx.end
        acc[:a] += grad[:a]
        return grad[a:b] + acc[a:b], None, None, None, None, None


class ChunkedAttention:
    """The forward of one layer's core attention over [cached keys/values of earlier chunks;
    this chunk]. It replaces the core attention module's ``forward`` and keeps the module in
    place, so parameters, extra state and checkpoint keys are those of the unchunked model.

    ``fused``: the module's own forward when it takes a bottom-right causal mask with fewer
    queries than keys (TE's: the fused kernels of the unchunked run); otherwise torch's
    scaled-dot-product attention."""

    def __init__(self, layer: int, state: ChunkState, softmax_scale: float, fused: Callable | None):
        self.layer, self.state, self.softmax_scale = layer, state, softmax_scale
        self.fused = fused

    def __call__(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None) -> torch.Tensor:  # fmt: skip
        if attention_mask is not None or attention_bias is not None or packed_seq_params is not None:
            raise ValueError("ChunkPipe attention takes causal chunks of one sample (no mask, bias or THD params)")
        st = self.state
        c = st.layer_cache(self.layer, key, value)
        window = (st.start, st.end, st.build_cache)
        keys = _CacheWindow.apply(key, c.keys, c.key_grads, *window)
        values = _CacheWindow.apply(value, c.values, c.value_grads, *window)
        attend = self._fused_segment if self.fused is not None else self._segment
        return torch.cat([attend(query, keys, values, lo, hi) for lo, hi in st.segments_in_chunk()])

    def _fused_segment(self, q, k, v, lo: int, hi: int) -> torch.Tensor:
        """Rows ``[max(start, lo), hi)`` of the chunk (``[s, b, h, d]``) against the segment's
        keys ``[lo, hi)``, bottom-right aligned causal: ``[s, b, h * d]``."""
        rows = slice(max(self.state.start, lo) - self.state.start, hi - self.state.start)
        return self.fused(q[rows], k[lo:hi], v[lo:hi], None, attn_mask_type=AttnMaskType.causal_bottom_right)

    def _segment(self, q, k, v, lo: int, hi: int) -> torch.Tensor:
        """The same with torch's attention: bottom-right aligned causal (the last query sees
        every key); on CUDA as a mask the fused kernels take without materialising it."""
        st = self.state
        # [s, b, h, d] -> [b, h, s, d]
        qs = q[max(st.start, lo) - st.start : hi - st.start].permute(1, 2, 0, 3)
        ks, vs = (x[lo:hi].permute(1, 2, 0, 3) for x in (k, v))
        sq, sk = qs.shape[2], ks.shape[2]
        if qs.is_cuda:
            mask = causal_lower_right(sq, sk)
        else:  # what CausalBias does off CUDA, spelt out (its tensor subclass trips dispatch modes)
            mask = torch.ones(sq, sk, dtype=torch.bool, device=qs.device).tril(sk - sq)
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=self.softmax_scale,
                                             enable_gqa=ks.shape[1] != qs.shape[1])  # fmt: skip
        b, h, s, d = out.shape
        return out.permute(2, 0, 1, 3).reshape(s, b, h * d)


def _decoder_layers(model: torch.nn.Module) -> list:
    return list(model.decoder.layers)


def _chunk_rope(rotary, state: ChunkState):
    """RoPE of the current chunk's positions: per segment piece, the table of just its position
    range (megatron's ``offset``), so no table grows with the sample. YaRN (MLA) returns the
    table with its attention scale, which depends on the config only: it is passed on."""
    original = rotary.forward

    def forward(max_seq_len: int, *args, **kwargs) -> torch.Tensor | tuple[torch.Tensor, float]:
        parts, scale = [], None
        for lo, hi in state.segments_in_chunk():
            pos = state.positions[max(state.start, lo) : hi]
            first, last = int(pos.min()), int(pos.max())
            table = original(last - first + 1, offset=first)  # [n, 1, 1, dim] (YaRN: and its mscale)
            if isinstance(table, tuple):
                table, scale = table
            parts.append(table[(pos - first).to(table.device)])
        return torch.cat(parts) if scale is None else (torch.cat(parts), scale)

    return forward


def _takes_mask_type(core: torch.nn.Module) -> bool:
    """Megatron's TE core attention passes the mask type through to TE at call time (its
    ``te_forward_mask_type``); the local one fixes it at construction."""
    return bool(getattr(core, "te_forward_mask_type", False))


def enable_chunkpipe(model: torch.nn.Module, fused_attention: bool = True) -> ChunkState:
    """Make ``model`` (a GPT model, unwrapped) run chunk by chunk; returns the state the
    schedule drives. Refuses models whose attention cannot be chunked this way.

    ``fused_attention``: keep the layers' own core attention where it takes a bottom-right
    causal mask (TE's: the fused kernels of the unchunked run); False, or a local layer
    backend, runs torch's scaled-dot-product attention."""
    cfg = model.config
    mla = bool(getattr(cfg, "multi_latent_attention", False))
    if mla and getattr(cfg, "dsa_indexer_topk", None) is not None:
        raise ValueError("ChunkPipe supports dense MLA; DeepSeek sparse attention (model.foundation.sparse_attention) "
                         "is not supported")  # fmt: skip
    if mla and cfg.apply_rope_fusion:  # fused MLA RoPE reads cached cos/sin tables, not the chunk's positions
        raise ValueError("ChunkPipe with MLA needs unfused RoPE (apply_rope_fusion=False)")
    for what in _moe_conflicts(cfg):
        raise ValueError(f"ChunkPipe cannot run MoE layers with {what}")
    if cfg.mtp_num_layers:  # megatron's MTP shifts tokens across the whole sample, not per chunk
        raise ValueError("ChunkPipe does not support multi-token prediction; set model.foundation.mtp_num_layers=null")
    if getattr(model, "position_embedding_type", "rope") != "rope":
        raise ValueError(f"ChunkPipe needs RoPE positions, the model uses {model.position_embedding_type!r}")
    if cfg.recompute_granularity is not None:
        raise ValueError(
            "ChunkPipe recomputes every chunk but the last itself; set model.foundation.recompute=null "
            f"(got {cfg.recompute_granularity!r}: megatron's checkpointing would rerun the cached attention)"
        )
    if cfg.context_parallel_size > 1:
        raise ValueError("ChunkPipe and context parallelism (parallel.cp > 1) cannot combine")
    layers = _decoder_layers(model)
    state = ChunkState(num_layers=len(layers))
    for i, layer in enumerate(layers):
        core = layer.self_attention.core_attention
        if isinstance(core.forward, ChunkedAttention):
            raise ValueError("ChunkPipe is already enabled on this model")
        mask = getattr(core, "attn_mask_type", AttnMaskType.causal)
        if getattr(mask, "name", mask) != "causal":  # megatron's enum (local) or TE's string ("causal")
            raise ValueError(f"ChunkPipe needs causal attention (layer {i} has {getattr(mask, 'name', mask)!r})")
        scale = getattr(core, "softmax_scale", None) or getattr(cfg, "softmax_scale", None)
        if scale is None:
            scale = cfg.kv_channels**-0.5
        fused = core.forward if fused_attention and _takes_mask_type(core) else None
        core.forward = ChunkedAttention(i, state, scale, fused)
    for rotary in _rotary_embeddings(model, layers):
        rotary.forward = _chunk_rope(rotary, state)
    return state


def _moe_conflicts(cfg) -> list[str]:
    """What of an MoE layer sees the whole micro-batch (chunks would change it)."""
    if not cfg.num_moe_experts:
        return []
    coeff = cfg.moe_aux_loss_coeff
    balancing = cfg.moe_router_load_balancing_type != "none" and any(
        c > 0 for c in (coeff if isinstance(coeff, list) else [coeff])
    )
    cannot = {"a load-balancing loss (set model.foundation.moe.load_balancing=none, aux_loss_coeff=0)": balancing,
              "the router z-loss (model.foundation.moe.z_loss_coeff)": bool(cfg.moe_z_loss_coeff),
              "token dropping (model.foundation.moe.capacity_factor)": cfg.moe_expert_capacity_factor is not None,
              "expert parallelism (parallel.ep > 1)": cfg.expert_model_parallel_size > 1}  # fmt: skip
    return [what for what, present in cannot.items() if present]


def _rotary_embeddings(model: torch.nn.Module, layers: list) -> list[torch.nn.Module]:
    """The model's RoPE table (GQA: one, passed to every layer) or each layer's own (MLA)."""
    shared = getattr(model, "rotary_pos_emb", None)
    own = [getattr(layer.self_attention, "rotary_pos_emb", None) for layer in layers]
    return [r for r in (shared, *own) if r is not None]


__all__ = ["ChunkState", "ChunkedAttention", "enable_chunkpipe"]
