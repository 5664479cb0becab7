"""The lightning indexer of DeepSeek sparse attention (DeepSeek-V3.2): its own small projections
that score every (query, key) pair cheaply so that attention can keep only the best keys.

    q_i[t, h] = rope(W_qb . qr[t])        (qr: the normalised query latent of MLA)
    k_i[t]    = rope(LayerNorm(W_k . x[t]))
    w[t, h]   = (W_w . x[t])[h] / sqrt(index_n_heads * index_head_dim)

and the scores ``I[t, s] = sum_h w[t, h] * relu(q_i[t, h] . k_i[s])`` are computed by
loong-kernels. Parameter names are megatron-core's ``DSAIndexer`` ones (``linear_wq_b``,
``linear_wk``, ``k_norm``, ``linear_weights_proj``), so checkpoints line up with megatron's DSA.

DeepSeek-V3.2 also applies a Hadamard rotation to ``q_i`` and ``k_i``. The rotation is
orthonormal, so it leaves every ``q_i . k_i`` unchanged in exact arithmetic; it only matters for
FP8 indexer kernels, which this module does not use, so it is left out.
"""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings import RotaryEmbedding, apply_rotary_pos_emb
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


class LightningIndexer(MegatronModule):
    """Computes ``(q_i [s, b, H_i, D_i], k_i [s, b, D_i], w [s, b, H_i])`` from ``x`` and ``qr``.

    Its weights are replicated on every tensor-parallel rank (it is small and needs all heads of
    the indexer for every query), as in megatron's DSA.
    """

    def __init__(self, config: TransformerConfig, **_unused) -> None:
        super().__init__(config=config)
        self.n_heads = config.dsa_indexer_n_heads
        self.head_dim = config.dsa_indexer_head_dim
        self.rope_dim = config.qk_pos_emb_head_dim
        dtype = config.params_dtype
        self.linear_wq_b = torch.nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False, dtype=dtype)
        self.linear_wk = torch.nn.Linear(config.hidden_size, self.head_dim, bias=False, dtype=dtype)
        self.k_norm = torch.nn.LayerNorm(self.head_dim, eps=config.layernorm_epsilon, dtype=dtype)
        self.linear_weights_proj = torch.nn.Linear(config.hidden_size, self.n_heads, bias=False, dtype=dtype)
        with torch.no_grad():
            for linear in (self.linear_wq_b, self.linear_wk, self.linear_weights_proj):
                config.init_method(linear.weight)
        for p in self.parameters():
            # Every TP rank computes the same indexer on the same (gathered) inputs; megatron
            # averages gradients of parameters tagged like this over the TP group.
            p.average_gradients_across_tp_domain = True
        # No parameters: the same RoPE frequencies as the attention's RoPE dims.
        self.rotary_pos_emb = RotaryEmbedding(
            self.rope_dim, rotary_percent=1.0, rotary_base=config.rotary_base, use_cpu_initialization=True
        )

    def _rope(self, t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        # RoPE on the leading rope_dim dims (DeepSeek-V3.2's layout: [rope | no rope]),
        # non-interleaved halves as in megatron's DSAIndexer default.
        pe, nope = t.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat([apply_rotary_pos_emb(pe, freqs, config=self.config), nope], dim=-1)

    def forward(
        self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x``: ``[s, b, hidden]``, ``qr``: ``[s, b, q_lora_rank]``: the full sequence, or under
        context parallelism this rank's tokens, whose positions in their sequence ``positions``
        (int64 ``[s]``) gives; None: ``0 .. s - 1``."""
        s, b, _ = x.shape
        # get_emb, not forward: megatron's RotaryEmbedding.forward cuts its table into this CP
        # rank's zigzag chunks itself, which is right only for the whole sequence's length
        if positions is None:
            freqs = self.rotary_pos_emb.get_emb(s)  # [s, 1, 1, rope_dim]
        else:
            freqs = self.rotary_pos_emb.get_emb(int(positions.max()) + 1)[positions.to(x.device)]
        freqs = freqs.to(x.device)
        q = self._rope(self.linear_wq_b(qr).view(s, b, self.n_heads, self.head_dim), freqs)
        k = self.k_norm(self.linear_wk(x)).view(s, b, 1, self.head_dim)
        k = self._rope(k, freqs).view(s, b, self.head_dim)
        w = self.linear_weights_proj(x) * (self.n_heads * self.head_dim) ** -0.5
        return q, k, w
