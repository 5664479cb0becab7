"""OmniCombinationModel: image encoder + image projector + foundation LLM.

The first pipeline stage (``pre_process``) holds the encoder and projector: it embeds the text,
encodes all images and video clips of the micro-batch in one packed ViT pass, projects them and
writes them over the placeholder tokens' embeddings, then runs its share of the foundation.
Every stage computes the multimodal RoPE positions from ``input_ids`` + grids (cheap host work),
so later stages need the token ids and grids, never the pixels. That bookkeeping (positions,
placeholder indices, the ViT's segments and windows) reads token ids and grids on the host: the
forward step keeps the grids there and passes the host copy of the token ids (``host_input_ids``)
and of the segment boundaries (``HostPackedSeqParams.bounds``), so a forward never waits for the
device.

Context parallelism (``cp_index``: the positions, into the whole packed sequence, of the tokens
this CP rank holds): the input ids, labels and loss mask are this rank's zigzag share, while
``host_input_ids`` and the packed boundaries stay the whole sequence's. Every CP rank encodes all
images of the micro-batch, computes the multimodal positions on the whole sequence, and keeps
the vision embeddings and positions of its own tokens; the encoder's gradient on each rank comes
from its tokens' loss only, so the data-parallel reduction over DP x CP sums it to the one-process
gradient.
"""

from __future__ import annotations

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from loong_models.host import to_device
from loong_models.image_encoder import ImageEncoder
from loong_models.image_projector import ImageProjector
from loong_models.omni.mrope import VisionTokenIds, mrope_positions
from loong_models.packed_seq import host_bounds

# The media inputs of forward(), as micro-batches carry them (loong_data.multimodal collates them).
MEDIA_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
HOST_MEDIA_KEYS = ("image_grid_thw", "video_grid_thw")  # read on the host only: they stay there

def mark_tp_replicas(sharded: dict, component_tp: int, foundation_tp: int, *, every_stage: bool = False) -> dict:
    """A component whose TP size is smaller than the foundation's (an encoder at TP=1 inside
    TP=2) is replicated over the foundation's TP group, but its own (smaller) TP group numbers
    each copy as TP rank 0: every copy would claim to be the main replica and megatron's
    distributed checkpointing refuses the duplicates. Appending the replica's index in the
    foundation's TP group makes exactly one copy the main replica (all-zero id). A component on
    ``every_stage`` of the pipeline is also copied over the stages: the index then counts the
    stage too (the first stage's TP rank 0 holds the main replica)."""
    if component_tp >= foundation_tp and not every_stage:
        return sharded
    from megatron.core import parallel_state as mpu
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace

    replica = mpu.get_tensor_model_parallel_rank() // component_tp
    if every_stage:
        replica += foundation_tp // component_tp * mpu.get_pipeline_model_parallel_rank()

    def mark(item):
        if hasattr(item, "replica_id"):
            rid = item.replica_id
            item.replica_id = (*rid, replica) if isinstance(rid, tuple) else (rid, replica)
        return item

    dict_list_map_inplace(mark, sharded)
    return sharded


class OmniCombinationModel(MegatronModule):
    """Modules: ``foundation`` (megatron GPTModel), ``image_encoder`` and ``image_projector``
    (first pipeline stage only, else None; on every stage with ``encoder_on_every_stage``, where
    a parallel encoder layout encodes on all of them).

    ``forward(input_ids, position_ids, attention_mask, labels=None, packed_seq_params=None,
    pixel_values=None, image_grid_thw=None, pixel_values_videos=None, video_grid_thw=None,
    second_per_grid_ts=None, host_input_ids=None, cp_index=None)`` -> per-token loss ``[1, S]`` with labels,
    logits without (hidden states on non-last pipeline stages), like GPTModel. ``host_input_ids``:
    the host copy of ``input_ids`` (without it, and without ``bounds`` in ``packed_seq_params``,
    the bookkeeping reads the device tensors back: a sync per read). ``cp_index``: context
    parallelism (see the module doc; ``host_input_ids`` is then required).
    """

    def __init__(
        self,
        config: TransformerConfig,
        foundation: MegatronModule,
        image_encoder: ImageEncoder | None,
        image_projector: ImageProjector | None,
        *,
        token_ids: VisionTokenIds,
        spatial_merge_size: int,
        mrope: bool,
        tokens_per_second: float = 2.0,
        encoder_on_every_stage: bool = False,
    ) -> None:
        super().__init__(config=config)
        self.foundation = foundation
        self.image_encoder = image_encoder
        self.image_projector = image_projector
        self.token_ids = token_ids
        self.spatial_merge_size = spatial_merge_size
        self.mrope = mrope
        self.tokens_per_second = tokens_per_second
        self.encoder_on_every_stage = encoder_on_every_stage
        self.pre_process = foundation.pre_process
        self.post_process = foundation.post_process
        self.model_type = foundation.model_type  # megatron's schedules read it from the chunk
        # (model, pixel_values, grid_thw) -> tokens: set by a parallel encoder layout; None = encode here
        self.vision_encode = None

    # --- what megatron's schedules and finalize_model_grads call on a model chunk ---
    def set_input_tensor(self, input_tensor) -> None:
        self.foundation.set_input_tensor(input_tensor)

    @property
    def share_embeddings_and_output_weights(self) -> bool:
        return self.foundation.share_embeddings_and_output_weights

    def shared_embedding_or_output_weight(self):
        return self.foundation.shared_embedding_or_output_weight()

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        out = self.foundation.sharded_state_dict(f"{prefix}foundation.", sharded_offsets, metadata)
        for name in ("image_encoder", "image_projector"):
            module = getattr(self, name)
            if module is not None:
                part = module.sharded_state_dict(f"{prefix}{name}.", (), metadata)
                out.update(mark_tp_replicas(part, module.config.tensor_model_parallel_size,
                                            self.config.tensor_model_parallel_size,
                                            every_stage=self.encoder_on_every_stage))  # fmt: skip
        return out

    # --- forward ---
    def positions(
        self,
        input_ids: torch.Tensor,
        packed_seq_params=None,
        image_grid_thw: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        second_per_grid_ts=None,
        *,
        host_input_ids: torch.Tensor | None = None,
        cp_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[3, 1, S]`` multimodal RoPE positions of a packed micro-batch, on ``input_ids``' device
        (computed from the host copies of the ids and boundaries when given); with ``cp_index``,
        those of this CP rank's tokens, from the whole sequence's (``host_input_ids``)."""
        cu = packed_seq_params.cu_seqlens_q if packed_seq_params is not None else None
        bounds = host_bounds(packed_seq_params)
        cu = torch.tensor(bounds) if bounds is not None else cu
        positions = mrope_positions(
            host_input_ids if host_input_ids is not None else input_ids, self.token_ids,
            spatial_merge_size=self.spatial_merge_size, image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw,
            second_per_grid_ts=second_per_grid_ts, tokens_per_second=self.tokens_per_second, cu_seqlens=cu,
        )  # fmt: skip
        if cp_index is not None:
            positions = positions.index_select(2, cp_index)
        return to_device(positions, input_ids.device)

    def vision_embeddings(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Encode and project: ``[N_patches, C*T*P*P]`` -> ``[N_patches / merge**2, hidden]``."""
        assert self.image_encoder is not None and self.image_projector is not None
        if self.vision_encode is not None:  # a parallel layout (loong_parallel.encoder_layout)
            return self.vision_encode(self, pixel_values, grid_thw)
        return self.image_projector(self.image_encoder(pixel_values, grid_thw))

    @property
    def deepstack_layers(self) -> int:
        """How many foundation layers take DeepStack features (0: none)."""
        return len(self.image_encoder.cfg.deepstack_visual_indexes) if self.image_encoder is not None else 0

    def _vision(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Projected vision tokens and, with DeepStack, each DeepStack layer's projected features."""
        if not self.deepstack_layers:
            return self.vision_embeddings(pixel_values, grid_thw), []
        if self.vision_encode is not None:
            raise ValueError("model.image_encoder.deepstack_visual_indexes with a parallel encoder layout "
                             "(encoder_layout / hetero DP) is not supported yet; use the default layout")  # fmt: skip
        h, feats = self.image_encoder.encode(pixel_values, grid_thw)
        merged = self.image_projector.project_deepstack(feats)  # merger j on tap j
        # foundation layer k takes the k-th shallowest tap (HF Qwen3-VL collects them in layer order)
        taps = self.image_encoder.cfg.deepstack_visual_indexes
        return self.image_projector(h), [merged[j] for j in sorted(range(len(taps)), key=taps.__getitem__)]

    def _merge(self, input_ids, embeddings, media, cp_index=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Write each kind's vision embeddings over its placeholder tokens (in order). Returns the
        embeddings and the DeepStack additions ``[K, S, B, H]`` (zero at text tokens; None without
        DeepStack or media). ``input_ids``: best the host copy (placeholders found without a sync).
        ``cp_index``: ``input_ids`` is the whole sequence, ``embeddings`` this CP rank's tokens."""
        deep = None
        for token_id, pixels, grid, kind in media:
            mask = input_ids[0] == token_id if token_id is not None else None
            count = int(mask.sum()) if mask is not None else 0
            if pixels is not None and pixels.shape[0] == 0:  # loong-data always sends the keys
                pixels = None
            if pixels is None:
                if count:
                    raise ValueError(f"{count} {kind} placeholder tokens but no pixel values for them")
                continue
            if grid is None:
                raise ValueError(f"pixel values for {kind}s given without their grid_thw")
            vision, feats = self._vision(pixels, grid)
            if vision.shape[0] != count:
                raise ValueError(f"{kind}s give {vision.shape[0]} tokens (grid_thw {grid.tolist()}, merge "
                                 f"{self.spatial_merge_size}) but the text has {count} placeholder tokens")  # fmt: skip
            index, rows = _placeholder_rows(mask, cp_index, embeddings.device)
            if rows is not None:  # context parallelism: the vision tokens at this rank's placeholders
                vision, feats = vision.index_select(0, rows), [f.index_select(0, rows) for f in feats]
            embeddings = embeddings.index_copy(0, index, vision.to(embeddings.dtype)[:, None, :])
            if feats:
                deep = embeddings.new_zeros(len(feats), *embeddings.shape) if deep is None else deep
                deep = deep.index_copy(1, index, torch.stack(feats).to(deep.dtype)[:, :, None, :])
        return embeddings, deep

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        labels: torch.Tensor | None = None,
        packed_seq_params=None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        second_per_grid_ts=None,
        host_input_ids: torch.Tensor | None = None,
        cp_index: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        self._check_context_parallel(cp_index, host_input_ids)
        if self.mrope:
            position_ids = self.positions(input_ids, packed_seq_params, image_grid_thw, video_grid_thw,
                                          second_per_grid_ts, host_input_ids=host_input_ids,
                                          cp_index=cp_index)  # fmt: skip
        decoder_input = None
        if self.pre_process:
            if input_ids.shape[0] != 1 and (pixel_values is not None or pixel_values_videos is not None):
                raise ValueError(f"media need one packed sequence per micro-batch (input_ids [1, S]), "
                                 f"got {tuple(input_ids.shape)}")  # fmt: skip
            embeddings = self.foundation.embedding(input_ids=input_ids, position_ids=None)  # [S, B, H]
            ids = host_input_ids if host_input_ids is not None else input_ids
            embeddings, deep = self._merge(ids, embeddings, (
                (self.token_ids.image_token_id, pixel_values, image_grid_thw, "image"),
                (self.token_ids.video_token_id, pixel_values_videos, video_grid_thw, "video"),
            ), cp_index)  # fmt: skip
            if self.config.sequence_parallel:
                embeddings = tensor_parallel.scatter_to_sequence_parallel_region(embeddings)
                if deep is not None:
                    deep = torch.stack([tensor_parallel.scatter_to_sequence_parallel_region(d) for d in deep])
            decoder_input = embeddings
            if deep is not None:  # DeepStack: added after the first layers (foundation/deepstack.py)
                kwargs["extra_block_kwargs"] = {**(kwargs.get("extra_block_kwargs") or {}), "context": deep}
        return self.foundation(
            input_ids, position_ids, attention_mask, decoder_input=decoder_input, labels=labels,
            packed_seq_params=packed_seq_params, **kwargs,
        )  # fmt: skip

    def _check_context_parallel(self, cp_index, host_input_ids) -> None:
        """Under context parallelism the vision bookkeeping needs the whole sequence's ids."""
        if self.config.context_parallel_size == 1:
            return
        if cp_index is None or host_input_ids is None:
            raise ValueError(
                f"context parallelism (parallel.cp={self.config.context_parallel_size}) on a VLM needs the "
                "micro-batch's whole token ids (host_input_ids) and this rank's positions (cp_index), "
                "as loong_parallel.lm_forward_step passes them for multimodal (data.kind=multimodal) batches"
            )


def _placeholder_rows(mask: torch.Tensor, cp_index: torch.Tensor | None, device: torch.device):
    """(where in ``embeddings`` the vision tokens go, on its device; which vision tokens, or
    None for all). ``mask``: the placeholders of the whole sequence (host)."""
    if cp_index is None:
        return to_device(mask.nonzero()[:, 0], device), None
    held = mask[cp_index]  # this rank's tokens that are placeholders
    local = held.nonzero()[:, 0]
    rows = (mask.cumsum(0) - 1)[cp_index[local]]  # each one's vision token (placeholder order)
    return to_device(local, device), to_device(rows, device)
