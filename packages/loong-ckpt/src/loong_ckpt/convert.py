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

from loong_ckpt.components import (
    BoundRule,
    bind,
    checkpoint_meta,
    config_from_meta,
    foundation_of,
    is_composed,
    mapping_of,
    model_from_hf,
    model_to_hf,
    naming_of,
    write_any_model_yaml,
)
from loong_ckpt.hf_config import ConversionError, model_name
from loong_ckpt.hf_io import CONFIG_FILE, HFReader, SafetensorsWriter, copy_tokenizer_files
from loong_ckpt.log import logger
from loong_ckpt.mcore_io import Chunk, model_template, read_metadata, read_regions, write_checkpoint
from loong_ckpt.training import FORMAT_VERSION, META_FILE, PARTIAL_SUFFIX, _write_atomic

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


def check_layout(cfg: Any, tp: int, pp: int) -> None:
    """The TP / PP layout must be able to hold the model (a FoundationConfig, or a composed
    ModelConfig: then its foundation, and its encoder's heads)."""
    if is_composed(cfg):
        enc = cfg.image_encoder
        enc_tp = enc.tensor_model_parallel_size or tp
        if enc.num_attention_heads % enc_tp:
            raise ConversionError(
                f"--tp={enc_tp} must divide the image encoder's attention heads ({enc.num_attention_heads})"
            )
        cfg = foundation_of(cfg)
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


def _groups(rules: list[BoundRule], layers: dict[str, int]) -> list[tuple[BoundRule, int | None]]:
    """Non-layer tensors first, then layer by layer (HF's usual order); ``layers``: megatron key
    -> number of layers (each component of a composed model has its own)."""
    flat = [(r, None) for r in rules if not r.layered]
    most = max((layers[r.mcore] for r in rules if r.layered), default=0)
    return flat + [(r, i) for i in range(most) for r in rules if r.layered and i < layers[r.mcore]]


def _num_layers(rule: BoundRule) -> int:
    return rule.cfg.num_layers  # the rule's component's layers


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
    cfg = model_from_hf(reader.config, str(src / CONFIG_FILE))
    check_layout(cfg, tp, pp)
    naming = naming_of(cfg, set(reader.tensors), str(src))
    rules = bind(cfg, naming)
    template = model_template(cfg)
    _check_rules_cover(template.tensors, rules, mapping_of(cfg).name if is_composed(cfg) else cfg.family)
    padded = foundation_of(cfg).padded_vocab_size(tp)
    layers = {r.mcore: template.tensors[r.mcore][0] for r in rules if r.layered}

    # Validate every HF tensor's presence and shape before writing anything.
    used: set[str] = set()
    for rule, layer in _groups(rules, layers):
        layer_shape = _layer_shape(rule.mcore, template.tensors[rule.mcore], rule.layered)
        for hf_name, expected in zip(rule.hf_names(layer), rule.hf_shapes(layer_shape)):
            if hf_name not in reader:
                raise ConversionError(f"{src}: tensor {hf_name} (for megatron key {rule.mcore}) is missing")
            got = reader.shape(hf_name)
            if got != expected:
                raise ConversionError(
                    f"{src / CONFIG_FILE} does not match the weights: {hf_name} in {reader.info(hf_name).file.name} "
                    f"has shape {got}, the config implies {expected} (megatron key {rule.mcore})"
                )
            used.add(hf_name)
    tied = {r.hf_name("lm_head.weight") for r in rules} if foundation_of(cfg).tie_word_embeddings else set()
    unused = sorted(set(reader.tensors) - used - tied)
    if unused:
        logger.warning("%d HF tensors are not converted: %s", len(unused), ", ".join(unused[:8]))
    first = next(r for r in rules if not r.layered)
    out_dtype = parse_dtype(dtype) or reader.info(first.hf_names(None)[0]).dtype

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
        t = rule.to_mcore([reader.read(n) for n in rule.hf_names(layer)], padded)
        bar.update(1)
        return t.unsqueeze(0) if rule.layered else t

    name = name or model_name(src)
    with atomic_output_dir(out, force) as tmp:
        write_checkpoint(tmp, chunks, template.objects, compute)
        bar.close()
        copied = copy_tokenizer_files(src, tmp)
        write_any_model_yaml(cfg, tmp / "configs", name)
        meta: dict[str, Any] = {
            "format_version": FORMAT_VERSION,
            "step": 0,
            "layout": None,  # layout-free: global tensors, loadable with any TP / PP
            "target_layout": {"tp": tp, "pp": pp},
            "time": time.time(),
            **checkpoint_meta(cfg),  # foundation (+ the other components of a composed model)
            "hf_config": reader.config,
            "source": {"hf_dir": str(src.absolute()), "converter": "loong-convert hf-to-mcore"},
            "model_name": name,
        }
        if naming is not None:
            meta["hf_naming"] = naming  # exported back with the same tensor names
        _write_atomic(tmp / META_FILE, json.dumps(meta, indent=2))
    command = f"uv run train 'hydra.searchpath=[file://{out}/configs]' model={name} train.init_from={out}"
    if any(f.startswith("tokenizer") for f in copied):
        command += f" data.tokenizer={out}"
    if tp > 1 or pp > 1:
        command += f" parallel.tp={tp} parallel.pp={pp}"
    res = ConvertResult(out, time.perf_counter() - t0, peak_rss_mib(), len(chunks), command, name)
    logger.info("wrote %s (%d tensors, %.1fs, peak RSS %.0f MiB)", out, len(chunks), res.seconds, res.peak_rss_mib)
    return res


def _check_rules_cover(tensors: dict[str, tuple[int, ...]], rules: list[BoundRule], family: str) -> None:
    keys = {r.mcore for r in rules}
    if missing := sorted(set(tensors) - keys):
        raise ConversionError(f"family {family}: no mapping rule for megatron keys {missing}")
    if extra := sorted(keys - set(tensors)):
        raise ConversionError(f"family {family}: rules name megatron keys the model does not have: {extra}")


def _checkpoint_model(src: Path, model: Any | None) -> tuple[Any, dict]:
    """The model config of a checkpoint: ``model`` when given, else what loong.json records."""
    meta_path = src / META_FILE
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    if model is not None:
        return model, meta
    if not (src / "metadata.json").is_file():
        raise ConversionError(f"{src} is not a megatron distributed checkpoint: metadata.json is missing")
    if "foundation" not in meta:
        raise ConversionError(
            f"{meta_path if meta else src} does not record the model config ('foundation'); "
            "pass it with --model-yaml <foundation yaml>"
        )
    return config_from_meta(meta), meta


def mcore_to_hf(
    src: str | Path,
    out: str | Path,
    *,
    dtype: str | None = None,
    tokenizer: str | Path | None = None,
    foundation: Any | None = None,
    force: bool = False,
    progress: bool = True,
    max_shard_bytes: int = 2 * 2**30,
) -> ConvertResult:
    """Convert a Loong / megatron checkpoint (any TP / PP layout) into an HF directory ``out``.
    ``foundation``: the model config (a FoundationConfig, or a composed ModelConfig) when the
    checkpoint does not record it."""
    t0 = time.perf_counter()
    src, out = Path(src), Path(out)
    check_output_dir(out, force)
    if src.name.endswith(PARTIAL_SUFFIX):
        raise ConversionError(f"{src} is an incomplete checkpoint (interrupted save); it cannot be converted")
    cfg, meta = _checkpoint_model(src, foundation)
    stored = read_metadata(src)
    rules = bind(cfg, meta.get("hf_naming"))
    layer_shapes: dict[str, tuple[int, ...]] = {}
    for r in rules:
        if r.mcore not in stored:
            raise ConversionError(f"{src}: megatron key {r.mcore} is missing from the checkpoint")
        shape = tuple(stored[r.mcore].size)
        if r.layered and shape[0] != _num_layers(r):
            raise ConversionError(
                f"{src}: {r.mcore} holds {shape[0]} layers, the model config has {_num_layers(r)} "
                f"({r.component})"
            )
        layer_shapes[r.mcore] = _layer_shape(r.mcore, shape, r.layered)
    out_dtype = parse_dtype(dtype)
    groups = _groups(rules, {r.mcore: _num_layers(r) for r in rules if r.layered})
    plan = []
    for rule, layer in groups:
        dt = out_dtype or stored[rule.mcore].properties.dtype
        for n, s in zip(rule.hf_names(layer), rule.hf_shapes(layer_shapes[rule.mcore])):
            plan.append((n, s, dt))
    final_dtype = plan[0][2]
    tok_src = tokenizer or src
    with atomic_output_dir(out, force) as tmp:
        writer = SafetensorsWriter(tmp, plan, max_shard_bytes)
        bar = tqdm(total=len(plan), unit="tensor", desc="mcore-to-hf", disable=not progress)
        try:
            # One read per layer (every key of that layer), then the non-layer tensors.
            current, buffers = None, {}
            for rule, layer in groups:
                if layer != current or not buffers:
                    current, buffers = layer, _read_group(src, rules, layer, layer_shapes, stored)
                for n, t in zip(rule.hf_names(layer), rule.to_hf(buffers[rule.mcore])):
                    writer.write(n, t.to(out_dtype or t.dtype))
                    bar.update(1)
            writer.close()
        finally:
            writer.abort()
            bar.close()
        hf_cfg = model_to_hf(cfg, final_dtype, meta.get("hf_config"))
        copy_tokenizer_files(tok_src, tmp)
        _write_atomic(tmp / CONFIG_FILE, json.dumps(hf_cfg, indent=2) + "\n")
    res = ConvertResult(out, time.perf_counter() - t0, peak_rss_mib(), len(plan))
    logger.info("wrote %s (%d tensors, %.1fs, peak RSS %.0f MiB)", out, len(plan), res.seconds, res.peak_rss_mib)
    return res


def _read_group(src: Path, rules: list[BoundRule], layer: int | None, layer_shapes, stored) -> dict:
    regions = {}
    for r in rules:
        if (layer is None) == r.layered or (r.layered and layer >= stored[r.mcore].size[0]):
            continue
        shape, dt = layer_shapes[r.mcore], stored[r.mcore].properties.dtype
        if r.layered:
            regions[r.mcore] = ((layer,) + (0,) * len(shape), torch.empty(1, *shape, dtype=dt))
        else:
            regions[r.mcore] = ((0,) * len(shape), torch.empty(*shape, dtype=dt))
    read_regions(src, regions)
    return {k: (buf[0] if layer is not None else buf) for k, (_, buf) in regions.items()}
