"""Offline conversion: HF directory <-> Loong (megatron distributed) checkpoint, streaming.

Both directions work tensor by tensor (one layer's tensors at most in memory) and write into
``<out>.partial``, renamed to ``<out>`` only once everything, metadata last, is on disk.
"""

from __future__ import annotations

import contextlib
import json
import resource
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from loong_ckpt.families import get_mapping
from loong_ckpt.hf_config import (
    ConversionError,
    foundation_from_dict,
    foundation_to_dict,
    from_hf_config,
    model_name,
    same_architecture,
    to_hf_config,
    write_model_yaml,
)
from loong_ckpt.hf_io import CONFIG_FILE, HFReader, SafetensorsWriter, copy_tokenizer_files, is_hf_dir
from loong_ckpt.log import logger
from loong_ckpt.mapping import Rule
from loong_ckpt.mcore_io import Chunk, model_template, read_metadata, read_regions, write_checkpoint
from loong_ckpt.training import FORMAT_VERSION, META_FILE, PARTIAL_SUFFIX, _write_atomic
from loong_models import FoundationConfig

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class ConvertResult:
    path: Path
    seconds: float
    peak_rss_mib: float
    tensors: int
    command: str | None = None  # for hf-to-mcore: the train command that starts from it
    model_name: str | None = None


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def parse_dtype(name: str | None) -> torch.dtype | None:
    if name in (None, "auto"):
        return None
    try:
        return _DTYPES[name]
    except KeyError:
        raise ConversionError(f"dtype {name!r}; allowed: auto, {', '.join(_DTYPES)}") from None


def check_output_dir(out: Path, force: bool) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise ConversionError(f"output directory {out} exists and is not empty; pass --force to replace it")


@contextlib.contextmanager
def atomic_output_dir(out: Path, force: bool) -> Iterator[Path]:
    """Yield ``<out>.partial``; on success it replaces ``out``; on failure it is removed."""
    check_output_dir(out, force)
    partial = out.with_name(out.name + PARTIAL_SUFFIX)
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        yield partial
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if out.exists():
        old = out.with_name(out.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
        partial.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        partial.rename(out)


def check_layout(cfg: FoundationConfig, tp: int, pp: int) -> None:
    """The TP / PP layout must be able to hold the model."""
    if tp < 1 or pp < 1:
        raise ConversionError(f"--tp={tp} --pp={pp}: both must be >= 1")
    if cfg.num_attention_heads % tp or cfg.query_groups % tp:
        raise ConversionError(
            f"--tp={tp} must divide the attention heads ({cfg.num_attention_heads}) and KV groups ({cfg.query_groups})"
        )
    if cfg.num_layers % pp:
        raise ConversionError(f"--pp={pp} must divide the model's {cfg.num_layers} layers")
    if cfg.padded_vocab_size(tp) != cfg.padded_vocab_size(1):
        raise ConversionError(
            f"--tp={tp} changes the padded vocabulary ({cfg.padded_vocab_size(1)} -> {cfg.padded_vocab_size(tp)}); "
            f"use a TP size dividing make_vocab_size_divisible_by={cfg.make_vocab_size_divisible_by}"
        )


def _layer_shape(key: str, shape: tuple[int, ...], layered: bool) -> tuple[int, ...]:
    return shape[1:] if layered else shape


def _groups(rules: list[Rule], num_layers: int) -> list[tuple[Rule, int | None]]:
    """Non-layer tensors first, then layer by layer (HF's usual order)."""
    flat = [(r, None) for r in rules if not r.layered]
    return flat + [(r, i) for i in range(num_layers) for r in rules if r.layered]


def hf_to_mcore(
    src: str | Path,
    out: str | Path,
    *,
    tp: int = 1,
    pp: int = 1,
    dtype: str | None = None,
    name: str | None = None,
    force: bool = False,
    progress: bool = True,
) -> ConvertResult:
    """Convert an HF directory into a complete Loong checkpoint directory ``out``."""
    t0 = time.perf_counter()
    src, out = Path(src), Path(out).absolute()
    check_output_dir(out, force)
    reader = HFReader(src)
    cfg = from_hf_config(reader.config, str(src / CONFIG_FILE))
    check_layout(cfg, tp, pp)
    mapping = get_mapping(cfg.family)
    rules = [r for r in mapping.rules if r.applies(cfg)]
    template = model_template(cfg)
    _check_rules_cover(template.tensors, rules, cfg.family)
    padded = cfg.padded_vocab_size(tp)

    # Validate every HF tensor's presence and shape before writing anything.
    used: set[str] = set()
    for rule, layer in _groups(rules, cfg.num_layers):
        layer_shape = _layer_shape(rule.mcore, template.tensors[rule.mcore], rule.layered)
        for hf_name, expected in zip(rule.hf_names(layer), rule.hf_shapes(layer_shape, cfg)):
            if hf_name not in reader:
                raise ConversionError(f"{src}: tensor {hf_name} (for megatron key {rule.mcore}) is missing")
            got = reader.shape(hf_name)
            if got != expected:
                raise ConversionError(
                    f"{src / CONFIG_FILE} does not match the weights: {hf_name} in {reader.info(hf_name).file.name} "
                    f"has shape {got}, the config implies {expected} (megatron key {rule.mcore})"
                )
            used.add(hf_name)
    unused = sorted(set(reader.tensors) - used - ({"lm_head.weight"} if cfg.tie_word_embeddings else set()))
    if unused:
        logger.warning("%d HF tensors are not converted: %s", len(unused), ", ".join(unused[:8]))
    out_dtype = parse_dtype(dtype) or reader.info(rules[0].hf_names(None)[0]).dtype

    chunks = []
    for key, shape in template.tensors.items():
        if key in template.layered:
            chunks += [Chunk(key, shape, (i,) + (0,) * (len(shape) - 1), (1, *shape[1:]), out_dtype)
                       for i in range(shape[0])]  # fmt: skip
        else:
            chunks.append(Chunk(key, shape, (0,) * len(shape), shape, out_dtype))
    by_key = {r.mcore: r for r in rules}
    bar = tqdm(total=len(chunks), unit="tensor", desc="hf-to-mcore", disable=not progress)

    def compute(chunk: Chunk) -> torch.Tensor:
        rule = by_key[chunk.key]
        layer = chunk.offsets[0] if rule.layered else None
        t = rule.to_mcore([reader.read(n) for n in rule.hf_names(layer)], cfg, padded)
        bar.update(1)
        return t.unsqueeze(0) if rule.layered else t

    name = name or model_name(src)
    with atomic_output_dir(out, force) as tmp:
        write_checkpoint(tmp, chunks, template.objects, compute)
        bar.close()
        copied = copy_tokenizer_files(src, tmp)
        write_model_yaml(cfg, tmp / "configs", name)
        meta: dict[str, Any] = {
            "format_version": FORMAT_VERSION,
            "step": 0,
            "layout": None,  # layout-free: global tensors, loadable with any TP / PP
            "target_layout": {"tp": tp, "pp": pp},
            "time": time.time(),
            "foundation": foundation_to_dict(cfg),
            "hf_config": reader.config,
            "source": {"hf_dir": str(src.absolute()), "converter": "loong-convert hf-to-mcore"},
            "model_name": name,
        }
        _write_atomic(tmp / META_FILE, json.dumps(meta, indent=2))
    command = f"uv run train 'hydra.searchpath=[file://{out}/configs]' model={name} train.init_from={out}"
    if any(f.startswith("tokenizer") for f in copied):
        command += f" data.tokenizer={out}"
    if tp > 1 or pp > 1:
        command += f" parallel.tp={tp} parallel.pp={pp}"
    res = ConvertResult(out, time.perf_counter() - t0, peak_rss_mib(), len(chunks), command, name)
    logger.info("wrote %s (%d tensors, %.1fs, peak RSS %.0f MiB)", out, len(chunks), res.seconds, res.peak_rss_mib)
    return res


def _check_rules_cover(tensors: dict[str, tuple[int, ...]], rules: list[Rule], family: str) -> None:
    keys = {r.mcore for r in rules}
    if missing := sorted(set(tensors) - keys):
        raise ConversionError(f"family {family}: no mapping rule for megatron keys {missing}")
    if extra := sorted(keys - set(tensors)):
        raise ConversionError(f"family {family}: rules name megatron keys the model does not have: {extra}")


def _checkpoint_foundation(src: Path, foundation: FoundationConfig | None) -> tuple[FoundationConfig, dict]:
    meta_path = src / META_FILE
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    if foundation is not None:
        return foundation, meta
    if not (src / "metadata.json").is_file():
        raise ConversionError(f"{src} is not a megatron distributed checkpoint: metadata.json is missing")
    if "foundation" not in meta:
        raise ConversionError(
            f"{meta_path if meta else src} does not record the model config ('foundation'); "
            "pass it with --model-yaml <foundation yaml>"
        )
    return foundation_from_dict(meta["foundation"]), meta


def mcore_to_hf(
    src: str | Path,
    out: str | Path,
    *,
    dtype: str | None = None,
    tokenizer: str | Path | None = None,
    foundation: FoundationConfig | None = None,
    force: bool = False,
    progress: bool = True,
    max_shard_bytes: int = 2 * 2**30,
) -> ConvertResult:
    """Convert a Loong / megatron checkpoint (any TP / PP layout) into an HF directory ``out``.
    A LoRA checkpoint (adapters only) is merged into the base weights it names (``W + s * B @ A``):
    the output is a plain model."""
    t0 = time.perf_counter()
    src, out = Path(src), Path(out)
    check_output_dir(out, force)
    if src.name.endswith(PARTIAL_SUFFIX):
        raise ConversionError(f"{src} is an incomplete checkpoint (interrupted save); it cannot be converted")
    cfg, meta = _checkpoint_foundation(src, foundation)
    lora = meta.get("lora")
    base = _lora_base(src, lora) if lora else src
    rules = [r for r in get_mapping(cfg.family).rules if r.applies(cfg)]
    groups = _groups(rules, cfg.num_layers)
    out_dtype = parse_dtype(dtype)
    if is_hf_dir(base):  # a LoRA run that started from HF weights
        read_group, plan = _hf_base(base, cfg, rules, groups, out_dtype)
    else:
        read_group, plan = _mcore_base(base, cfg, rules, groups, out_dtype)
    merge = _LoraMerge(src, lora) if lora else None
    final_dtype = plan[0][2]
    tok_src = tokenizer or base
    with atomic_output_dir(out, force) as tmp:
        writer = SafetensorsWriter(tmp, plan, max_shard_bytes)
        bar = tqdm(total=len(plan), unit="tensor", desc="mcore-to-hf", disable=not progress)
        try:
            # One read per layer (every key of that layer), then the non-layer tensors.
            current, buffers = None, {}
            for rule, layer in groups:
                if layer != current or not buffers:
                    current, buffers = layer, read_group(layer)
                    if merge:
                        merge(buffers, layer)
                for n, t in zip(rule.hf_names(layer), rule.to_hf(buffers[rule.mcore], cfg)):
                    writer.write(n, t.to(out_dtype or t.dtype))
                    bar.update(1)
            writer.close()
        finally:
            writer.abort()
            bar.close()
        if merge:
            merge.check_all_merged()
        hf_cfg = to_hf_config(cfg, final_dtype, meta.get("hf_config"))
        copy_tokenizer_files(tok_src, tmp)
        _write_atomic(tmp / CONFIG_FILE, json.dumps(hf_cfg, indent=2) + "\n")
    res = ConvertResult(out, time.perf_counter() - t0, peak_rss_mib(), len(plan))
    logger.info("wrote %s (%d tensors, %.1fs, peak RSS %.0f MiB)", out, len(plan), res.seconds, res.peak_rss_mib)
    return res


def _mcore_base(src: Path, cfg: FoundationConfig, rules: list[Rule], groups, out_dtype):
    """(layer -> {megatron key: global tensor}, HF write plan) for a megatron checkpoint."""
    stored = read_metadata(src)
    layer_shapes: dict[str, tuple[int, ...]] = {}
    for r in rules:
        if r.mcore not in stored:
            raise ConversionError(f"{src}: megatron key {r.mcore} is missing from the checkpoint")
        shape = tuple(stored[r.mcore].size)
        if r.layered and shape[0] != cfg.num_layers:
            raise ConversionError(f"{src}: {r.mcore} holds {shape[0]} layers, the model config has {cfg.num_layers}")
        layer_shapes[r.mcore] = _layer_shape(r.mcore, shape, r.layered)
    plan = []
    for rule, layer in groups:
        dt = out_dtype or stored[rule.mcore].properties.dtype
        for n, s in zip(rule.hf_names(layer), rule.hf_shapes(layer_shapes[rule.mcore], cfg)):
            plan.append((n, s, dt))
    return (lambda layer: _read_group(src, rules, layer, layer_shapes, stored)), plan


def _hf_base(src: Path, cfg: FoundationConfig, rules: list[Rule], groups, out_dtype):
    """The same for an HF directory (LoRA base weights): read and map to megatron's layout."""
    reader = HFReader(src)
    if not same_architecture(from_hf_config(reader.config, str(src / CONFIG_FILE)), cfg):
        raise ConversionError(f"{src / CONFIG_FILE} (the LoRA base) describes a different model than the checkpoint")
    plan = []
    for rule, layer in groups:
        for n in rule.hf_names(layer):
            if n not in reader:
                raise ConversionError(f"{src}: tensor {n} (for megatron key {rule.mcore}) is missing")
            plan.append((n, reader.shape(n), out_dtype or reader.info(n).dtype))
    padded = cfg.padded_vocab_size()

    def read_group(layer: int | None) -> dict[str, torch.Tensor]:
        return {r.mcore: r.to_mcore([reader.read(n) for n in r.hf_names(layer)], cfg, padded)
                for r in rules if (layer is None) != r.layered}  # fmt: skip

    return read_group, plan


def _lora_base(src: Path, lora: dict) -> Path:
    """The full weights a LoRA checkpoint's adapters were trained on (its ``train.init_from``)."""
    base = Path(lora.get("base") or "")
    if not lora.get("base") or not base.exists():
        raise ConversionError(f"{src} holds LoRA adapters only; their base weights {lora.get('base')!r} "
                              "(train.init_from of the run) do not exist")  # fmt: skip
    if not is_hf_dir(base) and json.loads((base / META_FILE).read_text()).get("params", "all") != "all":
        raise ConversionError(f"{src}: the LoRA base {base} is itself a partial (adapters-only) checkpoint")
    return base


class _LoraMerge:
    """Adds ``scale * B @ A`` of a LoRA checkpoint to the base tensors it adapts, layer by layer."""

    SUFFIXES = (".lora_a", ".lora_b")

    def __init__(self, src: Path, lora: dict) -> None:
        self.src, self.scale = src, float(lora["alpha"]) / int(lora["rank"])
        self.stored = read_metadata(src)
        # model tensors only: the optimizer's moments of the adapters share the suffixes
        self.adapted = {k.removesuffix(".lora_a") for k in self.stored if k.endswith(".lora_a")
                        and not k.startswith("optimizer.")}  # fmt: skip
        self.merged: set[str] = set()

    def __call__(self, buffers: dict[str, torch.Tensor], layer: int | None) -> None:
        regions = {}
        for key in buffers:
            stem = key.removesuffix(".weight")
            if stem in self.adapted:
                for k in (stem + ".lora_a", stem + ".lora_b"):
                    meta = self.stored[k]
                    shape = tuple(meta.size)
                    off = (layer,) + (0,) * (len(shape) - 1) if layer is not None else (0,) * len(shape)
                    buf = torch.empty(1, *shape[1:]) if layer is not None else torch.empty(*shape)
                    regions[k] = (off, buf.to(meta.properties.dtype))
        read_regions(self.src, regions)
        for stem in {k.rsplit(".", 1)[0] for k in regions}:
            a, b = (regions[stem + s][1] for s in self.SUFFIXES)
            if layer is not None:
                a, b = a[0], b[0]
            w = buffers[stem + ".weight"]
            if (b.shape[0], a.shape[1]) != tuple(w.shape):
                raise ConversionError(f"{self.src}: LoRA {stem} is {tuple(b.shape)} @ {tuple(a.shape)}, "
                                      f"the base weight {tuple(w.shape)}")  # fmt: skip
            buffers[stem + ".weight"] = (w.float() + self.scale * (b.float() @ a.float())).to(w.dtype)
            self.merged.add(stem)

    def check_all_merged(self) -> None:
        if missed := sorted(self.adapted - self.merged):
            raise ConversionError(f"{self.src}: LoRA adapters without a base weight to merge into: {missed}")


def _read_group(src: Path, rules: list[Rule], layer: int | None, layer_shapes, stored) -> dict[str, torch.Tensor]:
    regions = {}
    for r in rules:
        if (layer is None) == r.layered:
            continue
        shape, dt = layer_shapes[r.mcore], stored[r.mcore].properties.dtype
        if r.layered:
            regions[r.mcore] = ((layer,) + (0,) * len(shape), torch.empty(1, *shape, dtype=dt))
        else:
            regions[r.mcore] = ((0,) * len(shape), torch.empty(*shape, dtype=dt))
    read_regions(src, regions)
    return {k: (buf[0] if layer is not None else buf) for k, (_, buf) in regions.items()}
