"""Helpers for Loong's multi-process parity tests: a whole tensor cut to this rank's tensor-parallel
shard, and every parameter's gradient gathered back to its whole size, so that a TP layout can
start from one process's weights and be compared with its gradients. Not used by the package."""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu


def tp_shard(model: torch.nn.Module, name: str, param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This TP rank's part of ``full``, the whole value of ``model``'s parameter ``name``."""
    tp = mpu.get_tensor_model_parallel_group()
    if not getattr(param, "tensor_model_parallel", False) or tp.size() == 1:
        return full
    if _fc1_gated(model, name):  # each shard is [gate_r; up_r]
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp.size(), 0)[tp.rank()], up.chunk(tp.size(), 0)[tp.rank()]])
    return full.chunk(tp.size(), dim=param.partition_dim)[tp.rank()]


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """name -> the parameter's whole gradient (its ``main_grad``, from megatron's DDP), gathered over TP."""
    tp = mpu.get_tensor_model_parallel_group()
    out = {}
    for name, p in model.named_parameters():
        g = p.main_grad.detach().clone()
        if getattr(p, "tensor_model_parallel", False) and tp.size() > 1:
            shards = [torch.empty_like(g) for _ in range(tp.size())]
            dist.all_gather(shards, g, group=tp)
            if _fc1_gated(model, name):
                halves = [s.chunk(2, dim=0) for s in shards]
                shards = [h[0] for h in halves] + [h[1] for h in halves]
            g = torch.cat(shards, dim=p.partition_dim)
        out[name] = g
    return out


def _fc1_gated(model: torch.nn.Module, name: str) -> bool:
    """Whether a ``linear_fc1`` weight holds [gate; up] (a gated-linear-unit MLP's)."""
    if not name.endswith("linear_fc1.weight"):
        return False
    config = getattr(model.get_submodule(name.rsplit(".", 1)[0]), "config", None)
    return bool(getattr(config, "gated_linear_unit", False))
