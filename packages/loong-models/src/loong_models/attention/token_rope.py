"""Self-attention whose rotary embedding is given per token of a packed (THD) sequence.

A ViT's 2-D RoPE and a VLM's multimodal RoPE give one frequency row per token of the pack. For
THD input megatron-core applies RoPE segment by segment (``rope_utils._apply_rotary_pos_emb_thd``):
per attention layer and per q / k it reads ``cu_seqlens`` to the host and then each segment's
offset with ``.item()``, one device sync per segment. A Qwen2.5-VL micro-batch has hundreds of
window segments, so the ViT paid thousands of syncs (and slice kernels) per forward. With one
row per token the segments change nothing: rotating the whole ``[s, b, heads, dim]`` query and
key at once is the same arithmetic (megatron's per-segment path concatenates the same rows), with
no host read. This module does that right after the q / k projections (and q / k norms) and
hands megatron no rotary embedding; anything else (per-segment tables that restart at each
segment, a pair of q / k tables) goes through megatron's own path. Under context parallelism
the table must then hold this rank's tokens' rows (a VLM's positions are cut with its tokens).
"""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.transformer.attention import SelfAttention


class TokenRopeSelfAttention(SelfAttention):
    """megatron's SelfAttention; with a packed sequence and one rotary row per token it applies
    the rotation to the whole sequence without reading ``cu_seqlens`` (see the module doc).
    ``fused_rope``: TE's fused RoPE kernel (CUDA with TE), else megatron's unfused one, which
    gives exactly megatron's per-segment result."""

    def __init__(self, *args, fused_rope: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fused_rope = fused_rope
        self._token_freqs: torch.Tensor | None = None  # set for the duration of one forward

    def forward(self, hidden_states: torch.Tensor, attention_mask, *args, rotary_pos_emb=None,
                packed_seq_params=None, **kwargs):  # fmt: skip
        if not self._per_token(hidden_states, rotary_pos_emb, packed_seq_params):
            return super().forward(hidden_states, attention_mask, *args, rotary_pos_emb=rotary_pos_emb,
                                   packed_seq_params=packed_seq_params, **kwargs)  # fmt: skip
        self._token_freqs = rotary_pos_emb
        try:
            return super().forward(hidden_states, attention_mask, *args, rotary_pos_emb=None,
                                   packed_seq_params=packed_seq_params, **kwargs)  # fmt: skip
        finally:
            self._token_freqs = None

    def _per_token(self, hidden_states: torch.Tensor, freqs, packed_seq_params) -> bool:
        """A THD micro-batch whose rotary table has one row per token (the whole sequence: hidden
        states are sequence-sharded under sequence parallelism; under context parallelism, this
        rank's tokens: a VLM cuts its multimodal positions with the tokens)."""
        if (
            not isinstance(freqs, torch.Tensor)
            or packed_seq_params is None
            or packed_seq_params.qkv_format != "thd"
        ):
            return False
        if self.config.no_rope_freq:
            return False
        tokens = hidden_states.size(0) * (
            self.pg_collection.tp.size() if self.config.sequence_parallel else 1
        )
        return freqs.size(0) == tokens

    def get_query_key_value_tensors(self, *args, **kwargs):
        out = super().get_query_key_value_tensors(*args, **kwargs)
        if self._token_freqs is None:
            return out
        query, key, *rest = out  # [s, b, heads, dim]: megatron squeezes b for THD after this
        return (self._rotate(query), self._rotate(key), *rest)

    def _rotate(self, t: torch.Tensor) -> torch.Tensor:
        freqs = self._token_freqs
        fused = self.fused_rope and self._yarn_concentration_factor == 1.0  # TE's kernel has no mscale
        if fused and rope_utils.fused_apply_rotary_pos_emb is not None:
            return rope_utils.fused_apply_rotary_pos_emb(t, freqs, interleaved=self.config.rotary_interleaved)
        return rope_utils._apply_rotary_pos_emb_bshd(
            t,
            freqs,
            rotary_interleaved=self.config.rotary_interleaved,
            mscale=self._yarn_concentration_factor,
        )
