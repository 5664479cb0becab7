"""LoRA adapters in PEFT's layout (``adapter_config.json`` + ``adapter_model.safetensors``).

Loong adapts megatron's fused linears: one adapter pair on Q/K/V and one on SwiGLU's gate/up.
PEFT adapts HF's separate projections. Export splits a fused adapter exactly: ``lora_b``'s rows
split like the base weight's (the family's mapping rule), ``lora_a`` is shared by the parts, so
each part's update ``B_part @ A`` is the fused update's rows for that projection. The result loads
with ``peft.PeftModel.from_pretrained`` onto the HF base model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from loong_ckpt.components import bind_components, foundation_of, is_composed
from loong_ckpt.convert import _checkpoint_model
from loong_ckpt.hf_config import ConversionError
from loong_ckpt.mapping import locate, units
from loong_ckpt.mcore_io import read_metadata, read_regions
from loong_ckpt.output import atomic_output_dir, check_output_dir

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PeftModel wraps the HF model; keys keep its module paths


def _read_full(src: Path, stored: dict, keys: list[str]) -> dict[str, torch.Tensor]:
    regions = {}
    for k in keys:
        size = tuple(stored[k].size)
        regions[k] = ((0,) * len(size), torch.empty(size, dtype=stored[k].properties.dtype))
    read_regions(src, regions)
    return {k: t for k, (_, t) in regions.items()}


def _adapter_tensors(src: Path, cfg: Any, stored: dict) -> tuple[dict[str, torch.Tensor], set[str]]:
    """HF module path -> (lora_A, lora_B) tensors, and the module names adapted."""
    adapted = {k.removesuffix(".lora_a") for k in stored if k.endswith(".lora_a") and not k.startswith("optimizer.")}
    weight_keys = {stem + ".weight" for stem in adapted}
    f = foundation_of(cfg)
    out, modules, used = {}, set(), set()
    for rules, counts in bind_components(cfg):
        for rule, layer, expert in units(rules, counts):
            unit = locate(rule, layer, expert, weight_keys)
            if unit is None:
                continue
            if expert is not None:
                raise ConversionError(f"{src}: LoRA adapters on routed experts have no PEFT layout here")
            stem = unit.key.removesuffix(".weight")
            a, b = (t[unit.prefix] if unit.prefix else t
                    for t in _read_full(src, stored, [stem + ".lora_a", stem + ".lora_b"]).values())  # fmt: skip
            for name, b_part in zip(rule.hf_names(layer, expert), rule.to_hf(b, f)):
                module = name.removesuffix(".weight")
                out[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a.clone()  # one copy per projection (safetensors)
                out[f"{PEFT_PREFIX}{module}.lora_B.weight"] = b_part.contiguous()
                modules.add(module.rsplit(".", 1)[-1])
            used.add(stem)
    if missed := sorted(adapted - used):
        raise ConversionError(f"{src}: LoRA adapters without an HF projection to export to: {missed}")
    return out, modules


def export_peft(src: str | Path, out: str | Path, *, base_model: str | None = None, force: bool = False) -> Path:
    """Write the adapters of a Loong LoRA checkpoint ``src`` as a PEFT adapter directory ``out``
    (``base_model``: recorded as ``base_model_name_or_path``; default: the run's base weights)."""
    from safetensors.torch import save_file

    src, out = Path(src), Path(out)
    check_output_dir(out, force)
    cfg, meta = _checkpoint_model(src, None)
    lora = meta.get("lora")
    if not lora:
        raise ConversionError(f"{src} holds no LoRA adapters (loong.json has no 'lora'); export it with mcore-to-hf")
    if is_composed(cfg):
        raise ConversionError(f"{src}: PEFT export covers text models; export a VLM merged with mcore-to-hf")
    tensors, modules = _adapter_tensors(src, cfg, read_metadata(src))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": int(lora["rank"]),
        "lora_alpha": float(lora["alpha"]),
        "lora_dropout": float(lora.get("dropout", 0.0)),
        "target_modules": sorted(modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "inference_mode": True,
        "base_model_name_or_path": base_model or lora.get("base"),
    }
    with atomic_output_dir(out, force) as tmp:
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return out
