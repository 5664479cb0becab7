"""Multi-token-prediction (MTP) losses for the train app's log.

megatron's MTP layers (DeepSeek-V3's, ``model.foundation.mtp_num_layers``) add their loss to the
LM loss's gradient themselves (``MTPLossAutoScaler``, scaled by ``mtp_loss_scaling_factor``) and
record each training micro-batch's per-token loss, per MTP layer, in ``MTPLossLoggingHelper``'s
tracker on the ranks of the last pipeline stage. This reads and clears that tracker.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.transformer.transformer_config import TransformerConfig


class MTPStats:
    """The MTP layers' loss between two :meth:`report` calls."""

    def __init__(self, config: TransformerConfig, device: torch.device) -> None:
        self.layers, self.device = config.mtp_num_layers, device

    def report(self, microbatches: int, step: int) -> dict[str, float]:
        """Collective over all ranks (every rank must call it). ``mtp_loss``: the MTP layers'
        cross-entropy (without the scaling factor), mean over layers, the window's ``microbatches``
        micro-batches per data-parallel rank and the data-parallel ranks."""
        from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

        tracker = MTPLossLoggingHelper.tracker
        total = torch.zeros(self.layers, dtype=torch.float64, device=self.device)
        if "loss_values" in tracker:  # ranks of the last stage (every TP rank holds the same loss)
            total += tracker["loss_values"].to(total)
            MTPLossLoggingHelper.clean_metrics_in_tracker()
        dist.all_reduce(total)
        holders = dist.get_world_size() // mpu.get_pipeline_model_parallel_world_size()
        per_layer = total / holders / max(microbatches, 1)
        return {"mtp_loss": round(float(per_layer.mean()), 6)}

    def close(self) -> None:
        from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

        MTPLossLoggingHelper.tracker.clear()
