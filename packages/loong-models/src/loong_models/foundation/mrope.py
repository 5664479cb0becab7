"""Interleaved multimodal RoPE (Qwen3-VL): the rotary frequencies take the temporal, height and
width positions in turn (t h w t h w ...), where Qwen2-VL / 2.5-VL give each a contiguous block.

megatron-core's ``MultimodalRotaryEmbedding`` knows the block layout only; this subclass replaces
it on the foundation (``GPTModel.rotary_pos_emb``, built in foundation/build.py) and keeps its
call signature, so megatron's forward is unchanged."""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings.rope_utils import get_pos_emb_on_this_cp_rank
from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding


def interleave_sections(freqs: torch.Tensor, mrope_section: list[int]) -> torch.Tensor:
    """``freqs [3, ..., dim/2]`` (per position row) -> ``[..., dim/2]``: frequency ``j`` takes the
    height row when ``j % 3 == 1 and j < 3 * section[1]``, the width row when ``j % 3 == 2 and
    j < 3 * section[2]``, else the temporal row (HF's ``Qwen3VLTextRotaryEmbedding``)."""
    out = freqs[0].clone()
    for row in (1, 2):
        idx = slice(row, 3 * mrope_section[row], 3)
        out[..., idx] = freqs[row, ..., idx]
    return out


class InterleavedMultimodalRotaryEmbedding(MultimodalRotaryEmbedding):
    """``forward(position_ids [3, B, S], mrope_section) -> [S, B, 1, dim]`` (megatron's layout,
    rotate-half pairing)."""

    def forward(self, position_ids: torch.Tensor, mrope_section: list[int], cp_group=None) -> torch.Tensor:
        if self.rotary_interleaved:
            raise ValueError(
                "interleaved multimodal RoPE pairs dimensions by halves; rotary_interleaved must be off"
            )
        seq = position_ids.to(device=self.inv_freq.device, dtype=self.inv_freq.dtype)
        if self.seq_len_interpolation_factor is not None:
            seq = seq / self.seq_len_interpolation_factor
        freqs = interleave_sections(seq[..., None].float() * self.inv_freq, mrope_section)  # [B, S, dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)[..., None, :].transpose(0, 1).contiguous()
        cp_group = cp_group if cp_group is not None else self.cp_group
        if cp_group is not None and cp_group.size() > 1:
            emb = get_pos_emb_on_this_cp_rank(emb, 0, cp_group)
        return emb
