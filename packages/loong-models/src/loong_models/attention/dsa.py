"""DeepSeek sparse attention (DeepSeek-V3.2) as the core attention of megatron's absorbed MLA.

megatron-core's ``AbsorbedMLASelfAttention`` computes the projections and hands its core
attention the MQA layout of absorbed MLA:

* ``query`` ``[s, b, n, kv_lora_rank + rope]``: each head's no-RoPE query multiplied by that
  head's key up-projection (``q_nope . W_UK``, "W_UK folded into q") next to its RoPE part;
* ``key`` ``[s, b, 1, kv_lora_rank + rope]``: the normalised KV latent and the RoPE key, one
  head shared by all query heads; the values are the latent's first ``kv_lora_rank`` dims;
* ``x`` (the layer input after its norm) and ``qr`` (the normalised query latent).

The absorption is done at train time as well: ``q . k = (q_nope W_UK) . c_kv + q_pe . k_pe``
equals dense MLA's score exactly, and attending over the shared latent then applying ``W_UV``
(``AbsorbedMLASelfAttention`` does that after this module returns ``[s, b, n * kv_lora_rank]``)
equals dense MLA's output. It is what makes sparse attention cheap: the selected keys are
gathered once per query from one 576-wide latent row, not from ``n`` per-head keys.

This module runs the lightning indexer, top-k selection, sparse attention over the selected
keys and the indexer's KL loss through loong-kernels, whose dispatch picks the fused TileLang
kernels on CUDA (bf16/fp16) and the torch references elsewhere.

Packed (THD) input: every document is its own sequence (the indexer's RoPE restarts at its first
token, selection stays inside it). Context parallelism (``cp_comm_type="allgather"``, as
megatron-core's DSA): the rank holds its zigzag chunks of each sequence (:mod:`cp_layout`),
all-gathers the latent keys and the indexer's keys over the CP group, and selects and attends for
its own queries at their positions in the whole sequence; the gathers' backward reduce-scatters the
keys' gradients to their owners. That selection is rectangular, which the fused kernels do not
take: loong-kernels runs its references for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossAutoScaler
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig

from loong_kernels import (
    indexer_kl_loss,
    lightning_indexer_topk,
    lightning_indexer_topk_at,
    sparse_attention_head_mean_probs,
    sparse_mla_attention,
)
from loong_models.attention.cp_layout import token_layout
from loong_models.attention.packed import segment_bounds
from loong_models.packed_seq import host_bounds

# How DSAttention runs under context parallelism (``parallel.cp_comm_type``): megatron-core's DSA
# offers all-gather only, so does Loong's.
CP_COMM_TYPES = ("allgather",)


@dataclass
class DSAttentionSubmodules:
    indexer: ModuleSpec | type


class DSAttention(MegatronModule):
    """Core attention for ``AbsorbedMLASelfAttention`` (same constructor arguments as megatron's
    core attentions). Causal; returns the attention over the latent, ``[s, b, n * kv_lora_rank]``.

    In training with ``config.dsa_indexer_loss_coeff > 0`` the indexer's KL loss is attached to
    the output with megatron's ``DSAIndexerLossAutoScaler`` (the MoE aux-loss trick): the
    backward pass of the output also back-propagates the loss, scaled by what megatron's pipeline
    schedule sets through ``config.experimental_attention_variant_loss_scale_func``. The loss is
    a sum over query tokens with ``calculate_per_token_loss`` (like the LM loss, megatron then
    divides by the number of tokens) and a mean otherwise. ``indexer_loss`` keeps the last
    training forward's value, detached, for logging.
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: DSAttentionSubmodules,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"DSAttention is causal; got attn_mask_type={attn_mask_type}")
        cp = config.context_parallel_size > 1
        if cp and (cp_comm_type or "p2p") not in CP_COMM_TYPES:
            raise ValueError(f"DeepSeek sparse attention under context parallelism needs parallel.cp_comm_type="
                             f"{'|'.join(CP_COMM_TYPES)}, got {cp_comm_type!r}")  # fmt: skip
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"] if cp else ["tp"])
        self.tp_group = pg_collection.tp
        self.cp_group = pg_collection.cp if cp else None
        self.layer_number = layer_number
        self.topk = config.dsa_indexer_topk
        self.loss_coeff = config.dsa_indexer_loss_coeff or 0.0
        self.d_v = v_channels if v_channels is not None else config.kv_lora_rank
        # Absorbed MLA passes the dense MLA scale (1/sqrt(qk_head_dim + rope)), not 1/sqrt(576).
        self.softmax_scale = softmax_scale
        self.indexer = build_module(submodules.indexer, config=config)
        self.indexer_loss: torch.Tensor | None = None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        x: torch.Tensor,
        qr: torch.Tensor,
        up_v_weight: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        # up_v_weight, position_ids, attn_mask_type: AbsorbedMLASelfAttention passes them; the value
        # up-projection is left to it (it applies W_UV to the latent output), positions are implicit
        # (RoPE is already applied) and the mask type is causal by construction.
        cu = self._packed_bounds(packed_seq_params)
        if cu is not None:  # THD: megatron hands [t, n, d] queries, [t, 1, d] keys, [t, q_lora] qr
            query, key, qr = query.unsqueeze(1), key.unsqueeze(1), qr.unsqueeze(1)
        if value is not None or key.dim() != 4 or key.size(2) != 1:
            raise ValueError("DSAttention expects absorbed MLA's MQA layout: value=None, key [s, b, 1, d]")
        if attention_mask is not None or attention_bias is not None:
            raise ValueError("DSAttention is causal and takes no attention_mask / attention_bias")
        s, b, heads, _ = query.shape
        tp = self.tp_group.size()
        if self.config.sequence_parallel and tp > 1:
            # The indexer scores every query against every key: it needs the full sequence.
            x = gather_from_sequence_parallel_region(x, group=self.tp_group)
            qr = gather_from_sequence_parallel_region(qr, group=self.tp_group)
        with_loss = self.training and torch.is_grad_enabled() and self.loss_coeff > 0
        layout = self._layout(s, cu, query.device)
        # DeepSeek-V3.2 trains the indexer only through its loss, and its loss must not reach the
        # main model: the indexer reads detached inputs, and without the loss it needs no graph.
        with torch.set_grad_enabled(with_loss):
            q_i, k_i, w = self.indexer(x.detach(), qr.detach(), layout.positions)
        kv_all = key[:, :, 0]
        if layout.order is not None:
            # all-gather CP (megatron's DSA cp_comm_type=allgather): every rank selects and attends
            # over the whole sequence's latent keys and indexer keys; the gathers' backward
            # reduce-scatters their gradients back to the ranks that own those tokens
            kv_all = gather_from_sequence_parallel_region(kv_all, group=self.cp_group)[layout.order]
            k_i = gather_from_sequence_parallel_region(k_i, group=self.cp_group)[layout.order]
        cu_seqlens = torch.tensor(cu, dtype=torch.int32) if cu is not None else None

        outs, kl = [], []
        # One call per sequence: each sequence is one document of the packed-THD kernels, and
        # the dense [s, s] indexer scores stay per sequence rather than [b*s, b*s].
        for i in range(b):
            q, kv = query[:, i], kv_all[:, i]
            if layout.order is None:
                indices = lightning_indexer_topk(q_i[:, i], k_i[:, i], w[:, i], self.topk, cu_seqlens)
            else:
                indices = lightning_indexer_topk_at(q_i[:, i], k_i[:, i], w[:, i], self.topk, layout.rows, layout.starts)
            out, lse = sparse_mla_attention(q, kv, indices, self.d_v, self.softmax_scale)
            outs.append(out)
            if with_loss:
                target = sparse_attention_head_mean_probs(q.detach(), kv.detach(), indices, lse, self.softmax_scale)
                if tp > 1:
                    # Heads are split over TP ranks: the target averages over all of them.
                    dist.all_reduce(target, group=self.tp_group)
                    target /= tp
                kl.append(indexer_kl_loss(q_i[:, i], k_i[:, i], w[:, i], indices, target))
        output = torch.stack(outs, dim=1)  # [s, b, heads, d_v]
        if with_loss:
            # every sequence has s query rows; under CP the ranks' sums (per-token loss) add up to
            # the whole batch's, and their means (DDP averages over DP x CP) to its mean
            mean_kl = torch.stack(kl).mean()
            loss = self.loss_coeff * (mean_kl * (s * b) if self.config.calculate_per_token_loss else mean_kl)
            self.indexer_loss = loss.detach()
            output = DSAIndexerLossAutoScaler.apply(output, loss)
        output = output.reshape(s, b, heads * self.d_v)
        return output.squeeze(1) if cu is not None else output

    @staticmethod
    def _packed_bounds(packed_seq_params) -> list[int] | None:
        if packed_seq_params is None:
            return None
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"packed qkv_format must be 'thd', got {packed_seq_params.qkv_format!r}")
        cu, padded = packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_q_padded
        if padded is not None and not torch.equal(padded.cpu(), cu.cpu()):
            raise ValueError("cu_seqlens_q_padded != cu_seqlens_q: pad packs with a padding segment instead "
                             "(loong_data.collate_packed does)")  # fmt: skip
        return host_bounds(packed_seq_params) or segment_bounds(cu)

    def _layout(self, local_len: int, cu: list[int] | None, device: torch.device) -> _TokenLayout:
        if self.cp_group is None:
            if cu is None:
                return _TokenLayout()
            segment = torch.bucketize(torch.arange(local_len), torch.tensor(cu[1:]), right=True)
            return _TokenLayout(positions=torch.arange(local_len) - torch.tensor(cu)[segment])
        # CP: this rank's zigzag chunks of every sequence (THD: of every document); a token's row is
        # its index in the whole (packed) sequence, the order of the all-gathered tokens
        cp, rank = self.cp_group.size(), self.cp_group.rank()
        starts = torch.tensor(cu[:-1]) if cu is not None else torch.zeros(1, dtype=torch.long)
        held = [token_layout(local_len, cp, r, cu) for r in range(cp)]
        rows = [pos + starts[seg] for pos, seg in held]
        pos, seg = held[rank]
        return _TokenLayout(pos, rows[rank].to(device), starts[seg].to(device),
                            torch.argsort(torch.cat(rows)).to(device))  # fmt: skip


@dataclass
class _TokenLayout:
    """Where DSAttention's queries sit. ``positions`` (host): each token's position in its sequence /
    document (the indexer's RoPE; None: ``0 .. s - 1``). Under CP: ``rows``, each held token's index
    in the whole (packed) sequence; ``starts``, the index of its document's first token; ``order``,
    the permutation that puts the all-gathered (rank-major) tokens in sequence order."""

    positions: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    starts: torch.Tensor | None = None
    order: torch.Tensor | None = None
