"""ChunkPipe, the model side: a GPT model that runs one long sample chunk by chunk.

:func:`enable_chunkpipe` swaps every decoder layer's core attention for :class:`ChunkedAttention`
and makes the model's RoPE read the positions of the current chunk (applied from outside, like
LoRA: the layer specs stay as built). A :class:`ChunkState` holds, per layer, the keys / values of
the sample's earlier chunks as leaf tensors: a chunk attends to those plus its own (bottom-right
causal alignment: query ``i`` of the chunk sits at sample index ``start + i``), and backward
accumulates into the leaves' ``.grad`` the gradient that later chunks send to earlier chunks' keys
and values. The schedule (loong-parallel's :mod:`loong_parallel.chunkpipe`) runs backward in
reverse chunk order and feeds those gradients back in as extra roots.

Packed (THD) samples: a query sees a key only within its own segment (``boundaries``), and RoPE
positions restart per segment, across chunk boundaries too. Supported: rotary-embedding GQA / MHA
models (Llama, Qwen); MLA computes RoPE inside its attention and is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from torch.nn.attention.bias import causal_lower_right


@dataclass
class ChunkState:
    """The sample being run: its per-token RoPE positions and segments, the current chunk, and
    the key/value cache of earlier chunks (one list of (key, value) leaves per layer)."""

    num_layers: int
    positions: torch.Tensor | None = None  # [S] RoPE position of every token of the sample
    boundaries: list[int] = field(default_factory=list)  # segment (document) starts, then S
    chunk: int = 0  # index of the current chunk in the sample
    start: int = 0  # sample index of the current chunk's first token
    end: int = 0
    build_cache: bool = True  # first pass: append this chunk's keys/values to the cache
    cache: list[list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=list)
    live_kv: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # this pass's (k, v)

    def begin_sample(self, positions: torch.Tensor, boundaries: list[int]) -> None:
        self.positions, self.boundaries = positions, boundaries
        self.cache = [[] for _ in range(self.num_layers)]

    def segments_in_chunk(self) -> list[tuple[int, int]]:
        """(segment start, end of the segment's part up to this chunk's end) for every segment
        with tokens in the current chunk, in order."""
        b = self.boundaries
        return [(lo, min(hi, self.end)) for lo, hi in zip(b[:-1], b[1:]) if lo < self.end and hi > self.start]

    def begin_chunk(self, chunk: int, start: int, end: int, *, build_cache: bool) -> None:
        self.chunk, self.start, self.end, self.build_cache = chunk, start, end, build_cache
        self.live_kv = []

    def cached_kv_grads(self, chunk: int) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
        """Per layer: the gradient later chunks sent to this chunk's cached keys / values."""
        return [(k.grad, v.grad) for k, v in (layer[chunk] for layer in self.cache)]

    def end_sample(self) -> None:
        self.cache, self.live_kv, self.positions, self.boundaries = [], [], None, []


class ChunkedAttention(torch.nn.Module):
    """Core attention of one layer over [cached keys/values of earlier chunks; this chunk]."""

    def __init__(self, layer: int, state: ChunkState, softmax_scale: float):
        super().__init__()
        self.layer, self.state, self.softmax_scale = layer, state, softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None) -> torch.Tensor:  # fmt: skip
        if attention_mask is not None or attention_bias is not None or packed_seq_params is not None:
            raise ValueError("ChunkPipe attention takes causal chunks of one sample (no mask, bias or THD params)")
        st = self.state
        cache = st.cache[self.layer]
        st.live_kv.append((key, value))
        keys = torch.cat([k for k, _ in cache[: st.chunk]] + [key])
        values = torch.cat([v for _, v in cache[: st.chunk]] + [value])
        if st.build_cache:
            cache.append((key.detach().requires_grad_(), value.detach().requires_grad_()))
        # [s, 1, h, d] -> [1, h, s, d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, keys, values))
        out = torch.cat([self._segment(q, k, v, lo, hi) for lo, hi in st.segments_in_chunk()], dim=2)
        s, b, h, d = query.shape[0], out.shape[0], out.shape[1], out.shape[3]
        return out.permute(2, 0, 1, 3).reshape(s, b, h * d)

    def _segment(self, q, k, v, lo: int, hi: int) -> torch.Tensor:
        """Chunk rows ``[max(start, lo), hi)`` of the segment starting at sample index ``lo``
        against its keys ``[lo, hi)``: bottom-right aligned causal attention (the last query
        sees every key), which fused kernels take without a materialised mask."""
        st = self.state
        first = max(st.start, lo)
        qs = q[:, :, first - st.start : hi - st.start]
        ks, vs = k[:, :, lo:hi], v[:, :, lo:hi]
        mask = causal_lower_right(qs.shape[2], ks.shape[2])
        return F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=self.softmax_scale,
                                              enable_gqa=ks.shape[1] != qs.shape[1])  # fmt: skip


def _decoder_layers(model: torch.nn.Module) -> list:
    return list(model.decoder.layers)


def _chunk_rope(rotary, state: ChunkState):
    original = rotary.forward

    def forward(max_seq_len: int, *args, **kwargs) -> torch.Tensor:
        table = original(int(state.positions.max()) + 1)  # [max_pos + 1, 1, 1, dim]
        return table[state.positions[state.start : state.end].to(table.device)]

    return forward


def enable_chunkpipe(model: torch.nn.Module) -> ChunkState:
    """Make ``model`` (a GPT model, unwrapped) run chunk by chunk; returns the state the
    schedule drives. Refuses models whose attention cannot be chunked this way."""
    cfg = model.config
    if getattr(cfg, "multi_latent_attention", False):
        raise ValueError("ChunkPipe supports GQA / MHA attention; MLA (model.foundation.mla) is not supported yet")
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
        mask = getattr(core, "attn_mask_type", AttnMaskType.causal)
        if getattr(mask, "name", mask) != "causal":  # megatron's enum (local) or TE's string ("causal")
            raise ValueError(f"ChunkPipe needs causal attention (layer {i} has {getattr(mask, 'name', mask)!r})")
        scale = getattr(core, "softmax_scale", None) or getattr(cfg, "softmax_scale", None)
        if scale is None:
            scale = cfg.kv_channels**-0.5
        layer.self_attention.core_attention = ChunkedAttention(i, state, scale)
    if getattr(model, "rotary_pos_emb", None) is not None:
        model.rotary_pos_emb.forward = _chunk_rope(model.rotary_pos_emb, state)
    return state


__all__ = ["ChunkState", "ChunkedAttention", "enable_chunkpipe"]
