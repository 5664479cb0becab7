"""The TransformerConfig fields the runtime decides: layout, precision, loss normalisation."""

from __future__ import annotations

from typing import Any

import torch

from loong_parallel.config import ParallelConfig


def runtime_transformer_fields(pcfg: ParallelConfig, *, dtype: torch.dtype, device_type: str) -> dict[str, Any]:
    return dict(
        tensor_model_parallel_size=pcfg.tp,
        pipeline_model_parallel_size=pcfg.pp,
        virtual_pipeline_model_parallel_size=pcfg.vpp,
        sequence_parallel=pcfg.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        # On the host, build full weights then shard them: every TP layout starts from the same
        # weights for a seed. On a GPU, initialise shards in place (fast, no host copy).
        use_cpu_initialization=device_type == "cpu",
        # Loss = sum over tokens / tokens in the global batch, whatever the DP or micro-batch split.
        calculate_per_token_loss=True,
        deallocate_pipeline_outputs=True,
    )
