"""Multi-latent attention (MLA, DeepSeek-V2/V3) and DeepSeek sparse attention (DSA, DeepSeek-V3.2)
sub-configs of the foundation schema, with their validation and exact parameter counts.

Field names follow megatron-core (``MLATransformerConfig`` and the ``dsa_indexer_*`` fields of
``TransformerConfig``) so that build.py maps them one to one.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MLAConfig:
    """Low-rank compressed queries and a shared latent KV (DeepSeek-V2/V3 attention)."""

    q_lora_rank: int | None = 1536  # query latent width; None = a direct query projection
    kv_lora_rank: int = 512  # the shared latent KV width (the MQA "value" width when absorbed)
    qk_head_dim: int = 128  # per-head query/key width without RoPE ("nope")
    qk_pos_emb_head_dim: int = 64  # per-head RoPE width, shared by all heads on the key side
    v_head_dim: int = 128

    def validate(self, prefix: str) -> None:
        for key in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            if getattr(self, key) < 1:
                raise ValueError(f"{prefix}.{key}={getattr(self, key)} must be >= 1")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"{prefix}.q_lora_rank={self.q_lora_rank} must be >= 1 or null")
        if self.qk_pos_emb_head_dim % 2:
            raise ValueError(f"{prefix}.qk_pos_emb_head_dim={self.qk_pos_emb_head_dim} must be even (RoPE pairs)")

    def num_parameters(self, hidden_size: int, num_heads: int) -> int:
        """Projections and latent norms of one MLA layer (no biases, as in DeepSeek)."""
        h, n = hidden_size, num_heads
        q_head = self.qk_head_dim + self.qk_pos_emb_head_dim
        if self.q_lora_rank is None:
            q = h * n * q_head
        else:  # down, q_layernorm, up
            q = h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * n * q_head
        # down to latent + RoPE key, kv_layernorm, up to per-head key ("nope") and value
        kv = h * (self.kv_lora_rank + self.qk_pos_emb_head_dim) + self.kv_lora_rank
        kv += self.kv_lora_rank * n * (self.qk_head_dim + self.v_head_dim)
        out = n * self.v_head_dim * h
        return q + kv + out


@dataclass
class SparseAttentionConfig:
    """DeepSeek sparse attention: a lightning indexer picks ``index_topk`` keys per query."""

    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 2048
    # Weight of the indexer's KL loss. It is the indexer's only training signal (the indexer's
    # inputs are detached, and top-k selection has no gradient), so 0 leaves the indexer untrained.
    indexer_loss_coeff: float = 0.01

    def validate(self, prefix: str, mla: MLAConfig) -> None:
        for key in ("index_n_heads", "index_head_dim", "index_topk"):
            if getattr(self, key) < 1:
                raise ValueError(f"{prefix}.{key}={getattr(self, key)} must be >= 1")
        if self.indexer_loss_coeff < 0:
            raise ValueError(f"{prefix}.indexer_loss_coeff={self.indexer_loss_coeff} must be >= 0")
        # The indexer rotates the first qk_pos_emb_head_dim dims of its queries and keys.
        if self.index_head_dim < mla.qk_pos_emb_head_dim:
            raise ValueError(
                f"{prefix}.index_head_dim={self.index_head_dim} must be >= "
                f"mla.qk_pos_emb_head_dim={mla.qk_pos_emb_head_dim} (RoPE is applied to that many dims)"
            )

    def num_parameters(self, hidden_size: int, mla: MLAConfig) -> int:
        """The indexer of one layer: q from the query latent, k and head weights from the input,
        and a LayerNorm (weight and bias) on k."""
        assert mla.q_lora_rank is not None  # validated: the indexer reads the query latent
        q = mla.q_lora_rank * self.index_n_heads * self.index_head_dim
        k = hidden_size * self.index_head_dim + 2 * self.index_head_dim
        w = hidden_size * self.index_n_heads
        return q + k + w
