"""Router statistics of Mixture-of-Experts models, for the train app's log.

Two sources: megatron-core's MoE metrics tracker (``moe_logging.get_moe_metrics_tracker``), where
the routers record their auxiliary losses (load-balancing, z-loss) per layer; and a forward hook
on every router counting the tokens routed to each expert (megatron counts them only with
expert-bias balancing, and resets them each step).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.transformer.transformer_config import TransformerConfig

# megatron's tracker names for each balancing type (router.py), plus the z-loss
_AUX_LOSS_NAMES = {
    "aux_loss": "load_balancing_loss",
    "seq_aux_loss": "seq_load_balancing_loss",
    "global_aux_loss": "global_load_balancing_loss",
}


def _routers(chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
    from megatron.core.transformer.moe.router import Router

    # the decoder's routers: an MTP layer's router numbers its layer from 1 again (megatron)
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, Router) and not m.is_mtp_layer]


def ep_load_imbalance(counts: torch.Tensor, ep: int) -> torch.Tensor:
    """Per MoE layer, the busiest expert-parallel rank's routed tokens over the mean rank's.
    ``counts``: tokens per expert, one row per MoE layer; megatron places experts on the EP ranks
    in contiguous blocks of ``num_experts / ep``. Counted over a whole step, so it understates a
    single micro-batch's imbalance (hot experts may differ between micro-batches)."""
    layers, experts = counts.shape
    if experts % ep:
        raise ValueError(f"{experts} experts do not split over ep={ep} ranks")
    per_rank = counts.reshape(layers, ep, experts // ep).sum(2)
    return per_rank.max(1).values / per_rank.mean(1)


class RouterStats:
    """Counts routed tokens per expert and layer between two :meth:`report` calls.

    Counting happens only in forward passes with autograd on: evaluation is left out, and a layer
    recomputed for its backward (whose first forward ran without autograd) counts once, the same
    rule megatron applies to its expert-bias counts.
    """

    def __init__(self, chunks: list[torch.nn.Module], config: TransformerConfig, device: torch.device):
        self.config = config
        self.num_experts = config.num_moe_experts
        self.counts = torch.zeros(config.num_layers, self.num_experts, dtype=torch.float64, device=device)
        self._handles = [r.register_forward_hook(self._count) for r in _routers(chunks)]
        types = config.moe_router_load_balancing_type
        types = types if isinstance(types, list) else [types]
        self.loss_names = [_AUX_LOSS_NAMES[t] for t in types if t in _AUX_LOSS_NAMES]
        coeffs = config.moe_aux_loss_coeff
        if not any(coeffs if isinstance(coeffs, list) else [coeffs]):
            self.loss_names = []  # megatron records no loss it does not compute
        if config.moe_z_loss_coeff:
            self.loss_names.append("z_loss")

    def _count(self, router: torch.nn.Module, inputs, output) -> None:
        if not torch.is_grad_enabled():
            return
        _, routing_map = output
        with torch.no_grad():
            self.counts[router.layer_number - 1] += (
                routing_map.reshape(-1, self.num_experts).sum(0).to(self.counts)
            )

    def report(self, microbatches: int, step: int) -> dict[str, float | list[int]]:
        """Collective over all ranks (every rank must call it): the statistics since the last call,
        which ran ``microbatches`` training micro-batches per data-parallel rank.

        ``moe_tokens_per_expert``: tokens routed to each expert, summed over MoE layers and the
        global batches of the window; ``moe_load_imbalance``: the busiest expert's load over the
        mean load, averaged over MoE layers (1.0 = perfectly balanced; ``_max``: the worst layer);
        ``moe_ep_load_imbalance`` (expert parallelism only): the same for the EP ranks' shares
        (:func:`ep_load_imbalance`, averaged over MoE layers), the expert work the all-to-all makes the other ranks wait for;
        one entry per auxiliary loss megatron records (its value without the coefficient, mean
        over micro-batches and MoE layers), prefixed ``moe_``."""
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

        counts = self.counts.clone()
        dist.all_reduce(counts)  # layers of other pipeline stages, tokens of other DP / SP ranks
        if not self.config.sequence_parallel:
            counts /= mpu.get_tensor_model_parallel_world_size()  # TP ranks routed the same tokens
        self.counts.zero_()
        used = counts.sum(1) > 0  # MoE layers that routed tokens (dense layers stay 0)
        out: dict[str, float | list[int]] = {}
        if used.any():
            per_layer = counts[used]
            imbalance = per_layer.max(1).values / per_layer.mean(1)
            out["moe_load_imbalance"] = round(float(imbalance.mean()), 4)
            out["moe_load_imbalance_max"] = round(float(imbalance.max()), 4)
            ep = mpu.get_expert_model_parallel_world_size()
            if ep > 1:
                out["moe_ep_load_imbalance"] = round(float(ep_load_imbalance(per_layer, ep).mean()), 4)
            out["moe_tokens_per_expert"] = [int(round(x)) for x in per_layer.sum(0).tolist()]
        if self.loss_names:
            tracker = get_moe_metrics_tracker()
            mtp = self.config.mtp_num_layers  # MTP layers' routers record after the decoder's layers
            for name in self.loss_names:  # pipeline stages without MoE layers take part in the reduction
                tracker.ensure_initialized(name, self.config.num_layers + (mtp or 0), device=self.counts.device)
            losses: dict[str, torch.Tensor] = {}  # report() adds its aggregated "*loss" metrics here
            tracker.report(
                loss_scale=1.0 / max(microbatches, 1),
                iteration=step,
                track_names=self.loss_names,
                num_layers=self.config.num_layers,
                moe_layer_freq=self.config.moe_layer_freq,
                mtp_num_layers=mtp,
                total_loss_dict=losses,
            )
            out.update({f"moe_{name}": round(float(value), 6) for name, value in losses.items()})
        return out

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
