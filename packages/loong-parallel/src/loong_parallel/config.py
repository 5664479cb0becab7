"""How a job is laid out over devices. The data-parallel size is derived, never set."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from loong_parallel.balance.config import BalanceConfig


class MoEDispatcher(StrEnum):
    """How tokens reach their experts' ranks (megatron's moe_token_dispatcher_type)."""

    alltoall = "alltoall"
    allgather = "allgather"


class EncoderLayout(StrEnum):
    """Where a VLM's image encoder runs (loong_parallel.encoder_layout)."""

    shared = "shared"  # every rank of a TP group encodes every image of its micro-batch
    hetero_dp = "hetero_dp"  # the micro-batch's images split over the TP ranks, each encoded once
    decoupled = "decoupled"  # the step's images split over all TP x PP ranks, encoded before the schedule


class OffloadModule(StrEnum):
    """megatron-core's fine-grained activation offloading points (the input of each module goes to host)."""

    attn_norm = "attn_norm"
    qkv_linear = "qkv_linear"
    core_attn = "core_attn"
    attn_proj = "attn_proj"
    mlp_norm = "mlp_norm"
    expert_fc1 = "expert_fc1"
    moe_act = "moe_act"


class CPCommType(StrEnum):
    """How context-parallel ranks exchange attention inputs (megatron's cp_comm_type)."""

    p2p = "p2p"  # ring: key/value blocks travel around the CP ranks
    a2a = "a2a"  # all-to-all: each rank attends the whole sequence for heads / cp heads
    # all-gather: each rank attends its queries to the whole sequence's gathered keys / values;
    # DeepSeek sparse attention runs CP only this way (as megatron-core's DSA), dense attention never
    allgather = "allgather"


class GradAccumulation(StrEnum):
    """How gradients are added into DDP's ``main_grad`` (``parallel.grad_accumulation``)."""

    hooks = "hooks"
    batched = "batched"


class CudaGraphs(StrEnum):
    """Which CUDA graphs replay the training step's layers (megatron's ``cuda_graph_impl``)."""

    none = "none"
    # megatron-core's own per-layer graphs (CudaGraphManager): each transformer layer's forward and
    # backward are recorded during the first steps (cuda_graph_warmup_steps, 3) and captured by
    # megatron's schedules at the end of the warm-up; later steps replay them
    local = "local"


@dataclass
class ChunkPipeConfig:
    """ChunkPipe (loong_parallel.chunkpipe): each sample runs through the model in chunks of
    ``chunk_size`` tokens, attending to the cached keys / values of its earlier chunks; the
    activation memory is one chunk's whatever the sample length. null = off."""

    chunk_size: int | None = None

    @property
    def enabled(self) -> bool:
        return self.chunk_size is not None

    @staticmethod
    def moe_conflicts(moe: Any) -> dict[str, bool]:
        """What of a foundation's MoE config (loong_models' MoEConfig, or None) ChunkPipe cannot
        chunk exactly: MoE layers route each token on its own (chunks route as the sample does),
        but what sees the whole micro-batch does not split into chunks."""
        if moe is None:
            return {}
        return {
            f"model.foundation.moe.load_balancing={moe.load_balancing} (a balancing loss sees each chunk, not the "
            "sample; set none and aux_loss_coeff=0, e.g. with expert_bias=true)":
                moe.load_balancing != "none" and moe.aux_loss_coeff > 0,
            "model.foundation.moe.z_loss_coeff (the router z-loss averages over each chunk)": bool(moe.z_loss_coeff),
            "model.foundation.moe.capacity_factor (token dropping depends on the chunk's tokens)":
                moe.capacity_factor is not None,
        }  # fmt: skip


@dataclass
class ParallelConfig:
    tp: int = 1  # tensor parallel size
    pp: int = 1  # pipeline parallel size
    vpp: int | None = None  # virtual pipeline stages per rank (interleaved 1F1B); None = off
    sequence_parallel: bool = False  # shard activations along the sequence inside TP regions
    # Context parallelism: every sequence is split over cp ranks (load-balanced: 2 x cp chunks,
    # rank r holds chunks r and 2cp-1-r); attention runs over the CP group by cp_comm_type.
    cp: int = 1
    cp_comm_type: CPCommType = CPCommType.p2p
    distributed_optimizer: bool = False  # shard optimizer state across DP ranks (ZeRO-1)
    overlap_grad_reduce: bool = False  # overlap DP gradient reduction with backward
    overlap_param_gather: bool = False  # overlap the distributed optimizer's param all-gather
    grad_reduce_in_fp32: bool = True
    ddp_bucket_size: int | None = None  # elements per DDP bucket; None = megatron's default
    # How each parameter's gradient reaches DDP's main_grad: hooks (megatron's: a Python hook and
    # an add per parameter and micro-batch) or batched (one multi-tensor add per micro-batch:
    # loong_parallel.grad_accumulation; not with overlap_grad_reduce nor pipeline stages)
    grad_accumulation: GradAccumulation = GradAccumulation.hooks
    # Where a VLM's image encoder runs (loong_parallel.encoder_layout): shared (every TP rank
    # encodes every image) | hetero_dp (the images of a micro-batch split over the TP ranks;
    # needs model.image_encoder.tensor_model_parallel_size=1 and tp > 1) | decoupled (the images
    # of a step split over all TP x PP ranks, outside the pipeline schedule; needs pp > 1).
    encoder_layout: EncoderLayout = EncoderLayout.shared
    # Mixture-of-Experts layout (only for models with a `moe:` config). Experts are split over
    # ep ranks; each expert's weights over etp ranks (None = tp). Expert layers see
    # world / (etp x ep x pp) data-parallel replicas; the rest of the model keeps tp x pp x dp.
    ep: int = 1
    etp: int | None = None
    # How tokens reach their experts' ranks: alltoall (sends each token only where it is routed;
    # needed for the overlaps below) or allgather (every rank sees all tokens of its TP group).
    moe_token_dispatcher: MoEDispatcher = MoEDispatcher.alltoall
    # Run the shared experts on a side stream while the routed tokens are dispatched (CUDA).
    moe_shared_expert_overlap: bool = False
    # Hide the expert-parallel all-to-all behind another micro-batch's computation (megatron's
    # combined 1F1B schedule; CUDA, bf16/fp16, ep > 1, with pp > 1 only interleaved (vpp)).
    moe_a2a_overlap: bool = False
    # With moe_a2a_overlap: TE layers compute weight gradients apart from the input gradients, so
    # the combined schedule has more work to hide the other micro-batch's all-to-all behind
    # (megatron's delay_wgrad_compute; DDP's own flag follows, loong_parallel.model.ddp_config_for).
    moe_delay_wgrad: bool = False
    # Fine-grained activation offloading: the inputs of these modules are kept in host memory
    # between forward and backward (CUDA); empty = off.
    offload_activations: list[OffloadModule] = field(default_factory=list)
    # The weight-gradient GEMMs accumulate straight into DDP's fp32 main_grad: no bf16 weight
    # gradient and no separate add per parameter and micro-batch. TE linears through TE's fused
    # accumulation, megatron's own linears (the output layer) through loong_xpu's GEMMs in place of
    # apex's. true | false | null (auto: on where Transformer Engine runs). true on a model without
    # megatron / TE linears (pi05, Wan) is refused.
    wgrad_fusion: bool | None = False
    # CUDA graphs of the transformer layers (none | local: megatron's per-layer graphs, whole layer).
    # Needs CUDA and TE layers (TE's graph-safe RNG tracker); static shapes: not with packed (THD)
    # data, MoE layers, ChunkPipe, activation offloading or full recompute (megatron's rules)
    cuda_graphs: CudaGraphs = CudaGraphs.none
    # Data-parallel load balancing of packed samples (data.packing=thd)
    balance: BalanceConfig = field(default_factory=BalanceConfig)
    chunkpipe: ChunkPipeConfig = field(default_factory=ChunkPipeConfig)

    @property
    def expert_tp(self) -> int:
        return self.etp if self.etp is not None else self.tp

    def data_parallel_size(self, world_size: int) -> int:
        model_parallel = self.tp * self.pp * self.cp
        if world_size % model_parallel:
            raise ValueError(
                f"world size {world_size} is not divisible by parallel.tp * parallel.pp * parallel.cp = "
                f"{self.tp} * {self.pp} * {self.cp}; allowed: tp * pp * cp dividing {world_size}"
            )
        return world_size // model_parallel

    def validate(
        self,
        world_size: int,
        num_layers: int,
        num_heads: int,
        num_query_groups: int,
        *,
        num_experts: int | None = None,
        expert_ffn_hidden_size: int | None = None,
        has_shared_experts: bool = False,
    ) -> None:
        """Raise ValueError naming the key when the layout cannot hold the model. The MoE
        arguments describe the model's experts (None: a dense model)."""
        for error in self.balance.errors():
            raise ValueError(error)
        for key in ("tp", "pp", "ep", "cp"):
            if getattr(self, key) < 1:
                raise ValueError(f"parallel.{key}={getattr(self, key)} must be >= 1")
        self._validate_moe(world_size, num_experts, expert_ffn_hidden_size, has_shared_experts)
        self._validate_chunkpipe()
        self._validate_cuda_graphs(num_experts)
        if num_query_groups % self.tp or num_heads % self.tp:
            raise ValueError(
                f"parallel.tp={self.tp} must divide the attention heads ({num_heads}) and KV groups "
                f"({num_query_groups}) of the model"
            )
        stages = self.pp * (self.vpp or 1)
        if num_layers % stages:
            raise ValueError(
                f"parallel.pp={self.pp} x parallel.vpp={self.vpp or 1} = {stages} stages must divide "
                f"the model's {num_layers} layers"
            )
        if self.vpp is not None and self.pp < 2:
            raise ValueError(f"parallel.vpp={self.vpp} needs parallel.pp >= 2")
        if self.encoder_layout == EncoderLayout.hetero_dp and self.tp == 1:
            raise ValueError("parallel.encoder_layout=hetero_dp splits images over the TP ranks: it needs parallel.tp > 1")
        self._validate_decoupled()
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("parallel.sequence_parallel=true needs parallel.tp > 1")
        if self.grad_accumulation == GradAccumulation.batched and (self.overlap_grad_reduce or self.pp > 1):
            raise ValueError("parallel.grad_accumulation=batched adds gradients after each micro-batch's backward: "
                             "it needs parallel.overlap_grad_reduce=false and parallel.pp=1")  # fmt: skip
        if self.overlap_param_gather and not self.distributed_optimizer:
            raise ValueError("parallel.overlap_param_gather=true needs parallel.distributed_optimizer=true")
        if self.cp_comm_type not in tuple(CPCommType):  # OmegaConf checks it; direct construction does not
            allowed = ", ".join(CPCommType)
            raise ValueError(f"parallel.cp_comm_type={str(self.cp_comm_type)!r}; allowed: {allowed}")
        self.data_parallel_size(world_size)

    def _validate_decoupled(self) -> None:
        if self.encoder_layout != EncoderLayout.decoupled:
            return
        if self.pp < 2:
            raise ValueError("parallel.encoder_layout=decoupled spreads encoding over the pipeline stages: it needs "
                             "parallel.pp > 1 (use hetero_dp with pp=1)")  # fmt: skip
        unsupported = {"vpp": self.vpp is not None, "cp": self.cp > 1, "overlap_grad_reduce": self.overlap_grad_reduce}
        for key, bad in unsupported.items():
            # vpp / cp: the encoder's place in interleaved and context-parallel schedules is not built;
            # overlap_grad_reduce: the encoder's gradients arrive after the schedule's last backward
            if bad:
                raise ValueError(f"parallel.encoder_layout=decoupled does not support parallel.{key}="
                                 f"{getattr(self, key)} yet; use parallel.encoder_layout=shared or hetero_dp")  # fmt: skip

    def _validate_cuda_graphs(self, num_experts: int | None) -> None:
        """What megatron's whole-layer graphs cannot capture: a layer whose shapes or host syncs
        change per step (MoE dispatch counts tokens on the host), ChunkPipe's own schedule (it does
        not capture), and activation offloading (megatron refuses it with whole-layer graphs)."""
        if self.cuda_graphs == CudaGraphs.none:
            return
        if self.cuda_graphs not in tuple(CudaGraphs):
            allowed = ", ".join(CudaGraphs)
            raise ValueError(f"parallel.cuda_graphs={str(self.cuda_graphs)!r}; allowed: {allowed}")
        cannot = {"an MoE model (model.foundation.moe: the token dispatch syncs with the host)": num_experts is not None,
                  "parallel.chunkpipe": self.chunkpipe.enabled,
                  "parallel.offload_activations": bool(self.offload_activations)}  # fmt: skip
        for what, present in cannot.items():
            if present:
                raise ValueError(f"parallel.cuda_graphs={self.cuda_graphs} cannot combine with {what}")

    def _validate_chunkpipe(self) -> None:
        """What ChunkPipe runs with: data and pipeline parallelism (the model's own conflicts,
        e.g. an MoE balancing loss, are loong_models.chunked's)."""
        size = self.chunkpipe.chunk_size
        if size is None:
            return
        if size < 1:
            raise ValueError(f"parallel.chunkpipe.chunk_size={size} must be >= 1 (or null: off)")
        cannot = {"parallel.cp > 1": self.cp > 1, "parallel.tp > 1": self.tp > 1, "parallel.vpp": self.vpp is not None,
                  "parallel.overlap_grad_reduce": self.overlap_grad_reduce, "parallel.moe_a2a_overlap": self.moe_a2a_overlap,
                  "parallel.ep > 1": self.ep > 1}  # fmt: skip
        for what, present in cannot.items():
            if present:
                raise ValueError(f"parallel.chunkpipe cannot combine with {what}: supported are pp >= 1 and dp")

    def _validate_moe(
        self, world_size: int, num_experts: int | None, expert_ffn: int | None, has_shared: bool
    ) -> None:
        if self.etp is not None and self.etp < 1:
            raise ValueError(f"parallel.etp={self.etp} must be >= 1 or null (= parallel.tp)")
        if "attn_proj" in self.offload_activations and "core_attn" not in self.offload_activations:
            raise ValueError(
                "parallel.offload_activations: 'attn_proj' needs 'core_attn' too (megatron offloads them together)"
            )
        moe_keys = [k for k in ("moe_shared_expert_overlap", "moe_a2a_overlap", "moe_delay_wgrad") if getattr(self, k)]
        moe_keys += ["ep"] * (self.ep > 1) + ["etp"] * (self.etp is not None)
        if num_experts is None:
            if moe_keys:
                raise ValueError(
                    f"parallel.{moe_keys[0]} is set but the model has no experts (model.foundation.moe)"
                )
            return
        if num_experts % self.ep:
            raise ValueError(f"parallel.ep={self.ep} must divide the model's {num_experts} experts")
        if expert_ffn is not None and expert_ffn % self.expert_tp:
            raise ValueError(
                f"parallel.etp={self.expert_tp} must divide the experts' ffn_hidden_size ({expert_ffn})"
            )
        expert_mp = self.expert_tp * self.ep * self.pp
        if world_size % expert_mp:
            raise ValueError(
                f"world size {world_size} is not divisible by parallel.etp x parallel.ep x parallel.pp = "
                f"{self.expert_tp} x {self.ep} x {self.pp} = {expert_mp} (etp defaults to tp)"
            )
        if self.ep > 1 and self.tp > 1 and not self.sequence_parallel:
            raise ValueError(
                "parallel.ep > 1 with parallel.tp > 1 needs parallel.sequence_parallel=true (megatron: expert "
                "parallelism beside tensor parallelism must use sequence parallelism)"
            )
        if self.moe_shared_expert_overlap:
            if not has_shared:
                raise ValueError(
                    "parallel.moe_shared_expert_overlap=true but the model has no shared experts"
                )
            if self.moe_token_dispatcher != "alltoall":
                raise ValueError(
                    "parallel.moe_shared_expert_overlap=true needs parallel.moe_token_dispatcher=alltoall"
                )
        if self.moe_delay_wgrad and not self.moe_a2a_overlap:
            raise ValueError("parallel.moe_delay_wgrad=true needs parallel.moe_a2a_overlap=true (the delayed weight "
                             "gradients are work for the combined schedule to overlap)")  # fmt: skip
        if self.moe_delay_wgrad and self.grad_accumulation == GradAccumulation.batched:
            raise ValueError("parallel.moe_delay_wgrad=true cannot be combined with parallel.grad_accumulation=batched "
                             "(the delayed weight gradients land after the micro-batch's backward); use hooks")  # fmt: skip
        if self.moe_a2a_overlap:
            if self.ep < 2:
                raise ValueError(
                    "parallel.moe_a2a_overlap=true needs parallel.ep >= 2 (there is no all-to-all)"
                )
            if self.moe_token_dispatcher != "alltoall":
                raise ValueError("parallel.moe_a2a_overlap=true needs parallel.moe_token_dispatcher=alltoall")
            if self.moe_shared_expert_overlap:
                raise ValueError(
                    "parallel.moe_a2a_overlap and parallel.moe_shared_expert_overlap are exclusive "
                    "(the a2a overlap schedules the shared experts itself)"
                )
            if self.pp > 1 and self.vpp is None:
                raise ValueError(
                    "parallel.moe_a2a_overlap=true with parallel.pp > 1 needs parallel.vpp (interleaved)"
                )
