"""PEFT LoRA adapters into a Loong model's adapters, to continue training them (``model.lora.init_from``).

PEFT adapts q/k/v (and gate/up) separately, each with its own ``lora_A``; Loong has one adapter
on the fused linear. The import is exact by stacking: the fused ``lora_a`` holds the parts' A
matrices one below the other (rank ``n x r`` for n parts), the fused ``lora_b`` holds each part's
B in that part's rows and rank columns (zero elsewhere), so ``B @ A`` is, row block by row block,
each projection's ``B_j @ A_j``. Loong's one rank must therefore be at least ``n x r`` (3r with a
Q/K/V adapter); unused rank columns start at zero and stay there (their gradients are zero).
Loong's scale ``alpha / rank`` is matched by scaling B. Every rank loads its own tensor-parallel
share, with the base weights' mapping rules.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from loong_ckpt.components import bind_components, foundation_of, is_composed
from loong_ckpt.hf_config import ConversionError
from loong_ckpt.log import logger
from loong_ckpt.mapping import Rule, rule_key
from loong_ckpt.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX
from loong_ckpt.training import _unwrap

_UNSUPPORTED = {"use_rslora": True, "use_dora": True, "fan_in_fan_out": True}


class _Tensors:
    """A SliceReader over in-memory tensors (for the mapping rules' tensor-parallel slicing)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        t = self.tensors[name]
        return t if dim is None else t.narrow(dim, start, (stop if stop is not None else t.shape[dim]) - start)


def read_peft_adapter(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config.json, {HF module path: (lora_A, lora_B)}) of a PEFT LoRA directory."""
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / ADAPTER_CONFIG).is_file() or not (path / ADAPTER_WEIGHTS).is_file():
        raise ConversionError(f"{path} is not a PEFT adapter directory: {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS} expected")
    config = json.loads((path / ADAPTER_CONFIG).read_text())
    if config.get("peft_type") != "LORA":
        raise ConversionError(f"{path / ADAPTER_CONFIG}: peft_type={config.get('peft_type')!r}; LORA expected")
    for key, bad in _UNSUPPORTED.items():
        if config.get(key) == bad:
            raise ConversionError(f"{path / ADAPTER_CONFIG}: {key}={bad} has no Loong equivalent")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise ConversionError(f"{path / ADAPTER_CONFIG}: {key} (per-module ranks) is not supported")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in load_file(path / ADAPTER_WEIGHTS).items():
        module, _, kind = key.removeprefix(PEFT_PREFIX).rpartition(".lora_")
        if kind not in ("A.weight", "B.weight"):
            raise ConversionError(f"{path / ADAPTER_WEIGHTS}: {key} is not a LoRA A/B matrix")
        pairs.setdefault(module, {})[kind[0]] = t.float()
    return config, {m: (p["A"], p["B"]) for m, p in pairs.items()}


def _fused(rule: Rule, layer: int, adapter: dict, lora: Any, f: Any, ratio: float, where: str, b_shape: tuple | None):
    """Loong's global lora_a and, given ``b_shape`` (the fused lora_b's global shape), per HF weight
    name its lora_b rows, for one adapted linear. A projection PEFT leaves out gets zeros."""
    names = rule.hf_names(layer)
    found = [adapter.get(n.removesuffix(".weight")) for n in names]
    present = [p for p in found if p is not None]
    if not present:
        raise ConversionError(f"{where}: no adapter for {', '.join(names)}; leave "
                              f"{rule.mcore.rsplit('.', 2)[-2]} out of model.lora.targets")  # fmt: skip
    r, a_in = present[0][0].shape
    rank = lora.rank
    if len(names) * r > rank:
        raise ConversionError(f"{where}: {len(names)} projections of rank {r} share one Loong adapter: "
                              f"model.lora.rank must be >= {len(names) * r} (got {rank})")  # fmt: skip
    a = torch.zeros(rank, a_in)
    for j, pair in enumerate(found):
        if pair is not None:
            a[j * r : (j + 1) * r] = pair[0]
    if b_shape is None:
        return a, {}
    parts = {}
    for j, (name, pair, shape) in enumerate(zip(names, found, rule.hf_shapes(b_shape, f))):
        parts[name] = torch.zeros(shape)
        if pair is not None:
            parts[name][:, j * r : (j + 1) * r] = pair[1] * ratio
    return a, parts


def _adapted_modules(rules: set[Rule], f: Any) -> set[str]:
    """HF module paths of every layer's adapted projections (all pipeline stages)."""
    return {n.removesuffix(".weight") for r in rules for i in range(f.num_layers) if r.has_layer(f, i)
            for n in r.hf_names(i)}  # fmt: skip


def load_peft_adapters(path: str | Path, chunks: list[torch.nn.Module], cfg: Any) -> int:
    """Set the LoRA adapters of this rank's ``chunks`` (built for ModelConfig ``cfg``, with
    ``cfg.lora``) from the PEFT adapter at ``path``. Returns the adapter tensors set."""
    from megatron.core import parallel_state as mpu
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    if is_composed(cfg):
        raise ConversionError(f"model.lora.init_from={path}: PEFT adapters load into text models only")
    config, adapter = read_peft_adapter(path)
    f, where = foundation_of(cfg), f"model.lora.init_from={path}"
    ratio = (float(config["lora_alpha"]) / int(config["r"])) / cfg.lora.scale  # PEFT's scale over Loong's
    rules = {r.mcore: r for r in bind_components(cfg)[0][0]}
    tp = mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size()
    adapted, loaded = set(), 0
    for chunk in chunks:
        for name, entry in _unwrap(chunk).sharded_state_dict().items():
            kind = name.rsplit(".", 1)[-1]
            if kind not in ("lora_a", "lora_b"):
                continue
            sh = entry.build()[0] if isinstance(entry, ShardedTensorFactory) else entry
            key, layer = rule_key(sh.key)
            rule = rules[key.removesuffix(kind) + "weight"]
            layer = sh.global_offset[0] if layer is None else layer
            glob = tuple(sh.global_shape[sh.prepend_axis_num :])
            a, b_parts = _fused(rule, layer, adapter, cfg.lora, f, ratio, where, glob if kind == "lora_b" else None)
            whole = tuple(entry.data.shape) == glob
            if kind == "lora_b":  # the base's split: this rank's Q/K/V groups, gate and up halves
                local = rule.tp_shard(_Tensors(b_parts), layer, f, *((0, 1) if whole else tp), 0)
            else:  # replicated (column-parallel base), else split along the input like the base
                local = a if whole else a.chunk(tp[1], dim=1)[tp[0]]
            with torch.no_grad():
                entry.data.copy_(local.reshape(entry.data.shape))
            adapted.add(rule)
            loaded += 1
    if extra := sorted(set(adapter) - _adapted_modules(adapted, f)):
        raise ConversionError(f"{where}: PEFT adapts {extra[:4]}, which model.lora.targets does not adapt")
    logger.info("loaded %d LoRA adapter tensors from PEFT adapter %s", loaded, path)
    return loaded
