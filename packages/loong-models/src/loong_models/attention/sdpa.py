"""Core attention on torch's scaled_dot_product_attention.

megatron-core's local ``DotProductAttention`` materialises the [b, heads, s, s] score matrix.
This module has the same constructor and forward signature, so it drops into a megatron layer
spec, but lets torch pick a fused kernel (flash / memory-efficient on GPU, a blocked kernel on
CPU), which never materialises the full matrix for causal attention.

Packed (THD) micro-batches (``packed_seq_params.qkv_format == "thd"``) run one SDPA per
segment (causal for LLM documents, bidirectional for ViT images / windows) (see :mod:`loong_models.attention.packed`), so no token attends across a
document boundary and no [t, t] mask exists.

With context parallelism (``context_parallel_size > 1``) each rank holds a load-balanced slice
of every sequence and causal (or bidirectional, ``no_mask``: a DiT's video tokens) attention runs
over the CP group: ring (``cp_comm_type`` ``p2p``, the default) or all-to-all (``a2a``), see
:mod:`loong_models.attention.context_parallel`.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide

from loong_models.attention.context_parallel import CP_COMM_TYPES, context_parallel_attention
from loong_models.attention.packed import packed_causal_attention
from loong_models.packed_seq import host_bounds, host_segment_groups

CP_MASK_TYPES = (AttnMaskType.causal, AttnMaskType.no_mask)


class SDPAttention(MegatronModule):
    """Drop-in replacement for megatron's ``DotProductAttention`` (same arguments).

    Inputs are megatron's [s, b, heads, head_dim]; GQA key/value heads are broadcast by SDPA
    itself (``enable_gqa``) instead of being copied with ``repeat_interleave``.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
    ):
        super().__init__(config=config)
        if config.window_size is not None:
            raise ValueError("sliding-window attention needs Transformer Engine attention")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        tp_size = pg_collection.tp.size()
        self.cp_group = pg_collection.cp if config.context_parallel_size > 1 else None
        self.cp_comm_type = cp_comm_type or "p2p"
        if self.cp_group is not None:
            self._check_context_parallel(config, attn_mask_type, attention_dropout, tp_size)
        self.attn_mask_type = attn_mask_type
        self.num_heads = divide(config.num_attention_heads, tp_size)
        self.num_groups = divide(config.num_query_groups, tp_size)
        # MLA passes its query/key and value head sizes (they differ); SDPA reads them off the inputs
        del v_channels
        head_dim = k_channels or config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def _check_context_parallel(self, config, attn_mask_type, attention_dropout, tp_size: int) -> None:
        if self.cp_comm_type not in CP_COMM_TYPES:
            raise ValueError(
                f"cp_comm_type={self.cp_comm_type!r} is not supported by SDPAttention; allowed: "
                f"{', '.join(CP_COMM_TYPES)} (all_gather and a2a+p2p need Transformer Engine)"
            )
        if attn_mask_type not in CP_MASK_TYPES:
            raise ValueError("context parallelism with SDPAttention supports causal and bidirectional "
                             f"(no_mask) attention, not {attn_mask_type.name}")  # fmt: skip
        if (config.attention_dropout if attention_dropout is None else attention_dropout) > 0:
            raise ValueError("context parallelism with SDPAttention needs attention_dropout=0")
        cp = config.context_parallel_size
        if self.cp_comm_type == "a2a":
            for what, n in (("attention heads", config.num_attention_heads), ("KV groups", config.num_query_groups)):
                if (n // tp_size) % cp:
                    raise ValueError(
                        f"cp_comm_type='a2a' needs the {what} per TP rank ({n} / {tp_size}) divisible "
                        f"by parallel.cp={cp}; use 'p2p'"
                    )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by SDPAttention")
        mask_type = attn_mask_type or self.attn_mask_type
        if self.cp_group is not None:
            if attention_mask is not None or mask_type not in CP_MASK_TYPES:
                raise ValueError("context parallelism with SDPAttention supports causal and bidirectional "
                                 "(no_mask) attention without an explicit mask")  # fmt: skip
            cu = None
            if packed_seq_params is not None:
                if packed_seq_params.qkv_format != "thd":
                    raise ValueError(f"packed qkv_format must be 'thd', got {packed_seq_params.qkv_format!r}")
                cu = packed_seq_params.cu_seqlens_q
            return context_parallel_attention(query, key, value, comm_type=self.cp_comm_type, scale=self.softmax_scale,
                                              group=self.cp_group, cu_seqlens=cu,
                                              causal=mask_type == AttnMaskType.causal)  # fmt: skip
        if packed_seq_params is not None:
            return self._forward_packed(query, key, value, attention_mask, mask_type, packed_seq_params)
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        is_causal = mask_type == AttnMaskType.causal and attention_mask is None
        attn_mask = None
        if attention_mask is not None:
            attn_mask = ~attention_mask  # megatron masks True = "do not attend"; SDPA: True = attend
        dropout_p = self.dropout_p if self.training else 0.0
        kwargs = dict(attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=self.softmax_scale)
        if self.num_heads != self.num_groups:
            kwargs["enable_gqa"] = True
        if dropout_p > 0.0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = F.scaled_dot_product_attention(q, k, v, **kwargs)
        else:
            out = F.scaled_dot_product_attention(q, k, v, **kwargs)
        # [b, h, s, d] -> [s, b, h*d]
        b, h, s, d = out.shape
        return out.permute(2, 0, 1, 3).reshape(s, b, h * d)

    def _forward_packed(
        self, query, key, value, attention_mask, mask_type, packed_seq_params
    ) -> torch.Tensor:
        """THD: megatron hands [t, heads, d] (batch dimension squeezed) and reshapes [t, h*d] back."""
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(
                f"SDPAttention supports packed qkv_format 'thd' only, got {packed_seq_params.qkv_format!r}"
            )
        # causal: LLM documents; no_mask / padding without a mask: bidirectional per segment (ViT
        # images and windows; megatron's TE path maps no_mask to padding for THD the same way)
        bidirectional = (AttnMaskType.no_mask, AttnMaskType.padding)
        if attention_mask is not None or (
            mask_type != AttnMaskType.causal and mask_type not in bidirectional
        ):
            raise ValueError(
                "packed (THD) sequences are supported with causal or bidirectional (no_mask) "
                "attention and no explicit mask"
            )
        cu_q, cu_kv = packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_kv
        if cu_kv is not None and cu_kv is not cu_q and not torch.equal(cu_q, cu_kv):
            raise ValueError("packed self-attention needs cu_seqlens_q == cu_seqlens_kv")
        if packed_seq_params.cu_seqlens_q_padded is not None and not torch.equal(
            packed_seq_params.cu_seqlens_q_padded, cu_q
        ):
            raise ValueError(
                "cu_seqlens_q_padded != cu_seqlens_q: pad packs with a padding segment instead "
                "(loong_data.collate_packed does)"
            )
        dropout_p = self.dropout_p if self.training else 0.0
        run = partial(
            packed_causal_attention,
            query,
            key,
            value,
            cu_q,
            scale=self.softmax_scale,
            dropout_p=dropout_p,
            causal=mask_type == AttnMaskType.causal,
            bounds=host_bounds(packed_seq_params),
            by_length=host_segment_groups(packed_seq_params),
        )
        if dropout_p > 0.0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return run()
        return run()
