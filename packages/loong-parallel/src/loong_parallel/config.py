"""How a job is laid out over devices. The data-parallel size is derived, never set."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ParallelConfig:
    tp: int = 1  # tensor parallel size
    pp: int = 1  # pipeline parallel size
    vpp: int | None = None  # virtual pipeline stages per rank (interleaved 1F1B); None = off
    sequence_parallel: bool = False  # shard activations along the sequence inside TP regions
    distributed_optimizer: bool = False  # shard optimizer state across DP ranks (ZeRO-1)
    overlap_grad_reduce: bool = False  # overlap DP gradient reduction with backward
    overlap_param_gather: bool = False  # overlap the distributed optimizer's param all-gather
    grad_reduce_in_fp32: bool = True
    ddp_bucket_size: int | None = None  # elements per DDP bucket; None = megatron's default

    def data_parallel_size(self, world_size: int) -> int:
        model_parallel = self.tp * self.pp
        if world_size % model_parallel:
            raise ValueError(
                f"world size {world_size} is not divisible by parallel.tp * parallel.pp = "
                f"{self.tp} * {self.pp}; allowed: tp * pp dividing {world_size}"
            )
        return world_size // model_parallel

    def validate(self, world_size: int, num_layers: int, num_heads: int, num_query_groups: int) -> None:
        """Raise ValueError naming the key when the layout cannot hold the model."""
        for key in ("tp", "pp"):
            if getattr(self, key) < 1:
                raise ValueError(f"parallel.{key}={getattr(self, key)} must be >= 1")
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
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("parallel.sequence_parallel=true needs parallel.tp > 1")
        if self.overlap_param_gather and not self.distributed_optimizer:
            raise ValueError("parallel.overlap_param_gather=true needs parallel.distributed_optimizer=true")
        self.data_parallel_size(world_size)
