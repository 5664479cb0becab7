"""Offline conversion: HF directory <-> Loong (megatron distributed) checkpoint, streaming.

Both directions work tensor by tensor (one layer's tensors at most in memory) and write into
``<out>.partial``, renamed to ``<out>`` only once everything, metadata last, is on disk.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from loong_ckpt.components import (
    bind_components,
    checkpoint_meta,
    config_from_meta,
    foundation_of,
    is_composed,
    mapping_of,
    model_from_hf,
    model_to_hf,
    naming_of,
    same_model,
    write_any_model_yaml,
)
from loong_ckpt.diffusion import (
    diffusers_to_mcore,
    is_diffusers_wan,
    is_diffusion_checkpoint,
    mcore_to_diffusers,
)
from loong_ckpt.families import mtp_copies
from loong_ckpt.fp8_blocks import BlockWriter, fp8_layout
from loong_ckpt.hf_config import ConversionError, model_name
from loong_ckpt.hf_io import CONFIG_FILE, HFReader, SafetensorsWriter, copy_tokenizer_files, is_hf_dir
from loong_ckpt.integrity import check_files, hash_files, listed_files
from loong_ckpt.log import logger
from loong_ckpt.mapping import Rule, Unit, layer_key, locate, units
from loong_ckpt.mcore_io import Chunk, model_template, read_metadata, read_regions, write_checkpoint
from loong_ckpt.training import FORMAT_VERSION, META_FILE, PARTIAL_SUFFIX, _write_atomic
from loong_models import FoundationConfig
from loong_xpu.backends.cpu import peak_rss_bytes

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
    """This process's own peak resident memory (MiB), not its parent's (see
    :func:`loong_xpu.backends.cpu.peak_rss_bytes`)."""
    return peak_rss_bytes() / 2**20


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


def check_layout(cfg: Any, tp: int, pp: int, ep: int = 1) -> None:
    """The TP / PP / EP layout must be able to hold the model (a FoundationConfig, or a composed
    ModelConfig: its foundation, and its image encoder's heads)."""
    if is_composed(cfg):
        enc = cfg.image_encoder
        enc_tp = enc.tensor_model_parallel_size or tp
        if enc.num_attention_heads % enc_tp:
            raise ConversionError(
                f"--tp={enc_tp} must divide the image encoder's attention heads ({enc.num_attention_heads})"
            )
        cfg = foundation_of(cfg)
    if tp < 1 or pp < 1 or ep < 1:
        raise ConversionError(f"--tp={tp} --pp={pp} --ep={ep}: all must be >= 1")
    if cfg.mla is None and (cfg.num_attention_heads % tp or cfg.query_groups % tp):
        raise ConversionError(
            f"--tp={tp} must divide the attention heads ({cfg.num_attention_heads}) and KV groups ({cfg.query_groups})"
        )
    if cfg.mla is not None and cfg.num_attention_heads % tp:
        raise ConversionError(f"--tp={tp} must divide the attention heads ({cfg.num_attention_heads})")
    if cfg.num_layers % pp:
        raise ConversionError(f"--pp={pp} must divide the model's {cfg.num_layers} layers")
    moe = cfg.moe
    if ep > 1 and (moe is None or moe.num_experts % ep):
        raise ConversionError(
            f"--ep={ep} must divide the model's routed experts ({moe.num_experts if moe else 'none'})"
        )
    if cfg.padded_vocab_size(tp) != cfg.padded_vocab_size(1):
        raise ConversionError(
            f"--tp={tp} changes the padded vocabulary ({cfg.padded_vocab_size(1)} -> {cfg.padded_vocab_size(tp)}); "
            f"use a TP size dividing make_vocab_size_divisible_by={cfg.make_vocab_size_divisible_by}"
        )


def plan_units(rules: list[Rule], cfg: FoundationConfig, keys: Collection[str], where: str) -> list[Unit]:
    """Every (rule, layer, expert) tensor of ``cfg`` located among checkpoint ``keys``."""
    out = []
    for rule, layer, expert in units(rules, cfg):
        unit = locate(rule, layer, expert, keys)
        if unit is None:
            at = (
                rule.mcore
                if layer is None
                else f"{rule.mcore} (layer {layer}, or {layer_key(rule.mcore, layer)})"
            )
            raise ConversionError(f"{where}: megatron key {at} is missing")
        out.append(unit)
    return out


def check_hf_extras(reader: HFReader, cfg: FoundationConfig) -> None:
    """HF tensors that this mapping would silently drop but that carry model behaviour."""
    layers = cfg.num_layers + (cfg.mtp_num_layers or 0)  # MTP layers follow the decoder's in HF
    beyond = sorted(n for n in reader.tensors
                    if (m := re.match(r"model\.layers\.(\d+)\.", n)) and int(m.group(1)) >= layers)  # fmt: skip
    if beyond:
        raise ConversionError(
            f"{reader.path}: {len(beyond)} tensors belong to layers beyond num_hidden_layers={cfg.num_layers} + "
            f"num_nextn_predict_layers={cfg.mtp_num_layers or 0} (e.g. {beyond[0]}); if they are multi-token-"
            "prediction (MTP) layers, set num_nextn_predict_layers in config.json"
        )
    if fused := sorted(
        n for n in reader.tensors if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))
    ):
        raise ConversionError(
            f"{reader.path}: {fused[0]} holds all experts fused (transformers' internal layout, written by "
            "save_pretrained(save_original_format=False)); supported: one tensor per expert, "
            "model.layers.<i>.mlp.experts.<e>.{gate,up,down}_proj.weight (save_pretrained's default)"
        )


def hf_to_mcore(src: str | Path, out: str | Path, *, tp: int = 1, pp: int = 1, ep: int = 1, dtype: str | None = None,
                name: str | None = None, force: bool = False, progress: bool = True) -> ConvertResult:  # fmt: skip
    """Convert an HF directory (or a diffusers Wan transformer) into a Loong checkpoint ``out``."""
    if is_diffusers_wan(src):
        return diffusers_to_mcore(src, out, dtype=dtype, force=force, progress=progress)
    t0 = time.perf_counter()
    src, out = Path(src), Path(out).absolute()
    check_output_dir(out, force)
    reader = HFReader(src)
    model_cfg = model_from_hf(reader.config, str(src / CONFIG_FILE))  # a ModelConfig for a VLM
    cfg = foundation_of(model_cfg)
    check_layout(model_cfg, tp, pp, ep)
    check_hf_extras(reader, cfg)
    naming = naming_of(model_cfg, set(reader.tensors), str(src))
    what = mapping_of(model_cfg).name if is_composed(model_cfg) else cfg.family
    template = model_template(model_cfg)
    where = f"family {what}: a rule names a key the built model lacks;"
    plan = [u for rules, counts in bind_components(model_cfg, naming)  # per component: its own layers
            for u in plan_units(rules, counts, template.tensors, where)]  # fmt: skip
    rules = [u.rule for u in plan if u.layer is None]
    _check_rules_cover(template.tensors, plan, what)
    padded = cfg.padded_vocab_size(tp)

    # Validate every HF tensor's presence and shape before writing anything.
    used: set[str] = set()
    for u in plan:
        unit_shape = template.tensors[u.key][len(u.prefix) :]
        for hf_name, expected in zip(u.rule.hf_names(u.layer, u.expert), u.rule.hf_shapes(unit_shape, cfg)):
            if hf_name not in reader:
                raise ConversionError(f"{src}: tensor {hf_name} (for megatron key {u.key}) is missing")
            got = reader.shape(hf_name)
            if got != expected:
                raise ConversionError(
                    f"{src / CONFIG_FILE} does not match the weights: {hf_name} in {reader.info(hf_name).file.name} "
                    f"has shape {got}, the config implies {expected} (megatron key {u.key})"
                )
            used.add(hf_name)
    used |= _check_mtp_copies(reader, cfg)
    unused = sorted(set(reader.tensors) - used - ({"lm_head.weight"} if cfg.tie_word_embeddings else set()))
    if unused:
        logger.warning("%d HF tensors are not converted: %s", len(unused), ", ".join(unused[:8]))
    out_dtype = parse_dtype(dtype) or reader.info(rules[0].hf_names(None)[0]).dtype

    chunks, by_chunk = [], {}
    for u in plan:
        shape = template.tensors[u.key]
        n = len(u.prefix)
        c = Chunk(
            u.key, shape, u.prefix + (0,) * (len(shape) - n), (1,) * n + shape[n:], u.rule.dtype or out_dtype
        )
        chunks.append(c)
        by_chunk[(c.key, c.offsets)] = u
    bar = tqdm(total=len(chunks), unit="tensor", desc="hf-to-mcore", disable=not progress)

    def compute(chunk: Chunk) -> torch.Tensor:
        u = by_chunk[(chunk.key, chunk.offsets)]
        t = u.rule.to_mcore([reader.read(n) for n in u.rule.hf_names(u.layer, u.expert)], cfg, padded)
        bar.update(1)
        return t.reshape(chunk.sizes)

    name = name or model_name(src)
    with atomic_output_dir(out, force) as tmp:
        write_checkpoint(tmp, chunks, template.objects, compute)
        bar.close()
        copied = copy_tokenizer_files(src, tmp)
        write_any_model_yaml(model_cfg, tmp / "configs", name)
        meta: dict[str, Any] = {
            "format_version": FORMAT_VERSION,
            "step": 0,
            "layout": None,  # layout-free: global tensors, loadable with any TP / PP / EP
            "target_layout": {"tp": tp, "pp": pp, **({"ep": ep} if cfg.moe is not None else {})},
            "time": time.time(),
            **checkpoint_meta(model_cfg),  # foundation (+ the other components of a composed model)
            "hf_config": reader.config,
            "source": {"hf_dir": str(src.absolute()), "converter": "loong-convert hf-to-mcore"},
            "model_name": name,
        }
        if naming is not None:
            meta["hf_naming"] = naming  # exported back with the same tensor names
        meta["files"] = hash_files(tmp, listed_files(tmp, META_FILE))  # checked by train.init_from
        _write_atomic(tmp / META_FILE, json.dumps(meta, indent=2))
    # phase=finetune: the app's fine-tuning rates (pretraining rates undo pretrained weights)
    command = (f"uv run train 'hydra.searchpath=[file://{out}/configs]' model={name} train.init_from={out} "
               "phase=finetune")  # fmt: skip
    if any(f.startswith("tokenizer") for f in copied):
        command += f" data.tokenizer={out}"
    if tp > 1 or pp > 1:
        command += f" parallel.tp={tp} parallel.pp={pp}"
    if ep > 1:
        command += f" parallel.ep={ep}"
    res = ConvertResult(out, time.perf_counter() - t0, peak_rss_mib(), len(chunks), command, name)
    logger.info(
        "wrote %s (%d tensors, %.1fs, peak RSS %.0f MiB)", out, len(chunks), res.seconds, res.peak_rss_mib
    )
    return res


def _check_mtp_copies(reader: HFReader, cfg: FoundationConfig) -> set[str]:
    """The MTP layers' copies of the embedding and head (megatron shares the main ones): present
    and equal to what they copy, else the conversion would change the model."""
    for copy, src in mtp_copies(cfg).items():
        if copy not in reader:
            raise ConversionError(f"{reader.path}: tensor {copy} (the MTP layer's copy of {src}) is missing")
        if not torch.equal(reader.read(copy), reader.read(src)):
            raise ConversionError(f"{reader.path}: {copy} differs from {src}; megatron's MTP layers share the "
                                  "main model's embedding and output head, so it cannot be converted")  # fmt: skip
    return set(mtp_copies(cfg))


def _copies_by_source(cfg: FoundationConfig) -> dict[str, list[str]]:
    """HF tensor -> the HF tensors written as its copies (the MTP layers' embedding and head)."""
    of: dict[str, list[str]] = {}
    for copy, src in mtp_copies(cfg).items():
        of.setdefault(src, []).append(copy)
    return of


def _with_copies(plan: list, copies: dict[str, list[str]]) -> list:
    """The HF write plan (name, shape, dtype) with each copy right after the tensor it copies."""
    return [e for entry in plan for e in (entry, *((c, *entry[1:]) for c in copies.get(entry[0], ())))]


def _check_rules_cover(tensors: dict[str, tuple[int, ...]], plan: list[Unit], family: str) -> None:
    """The rules account for every tensor of the model, and every stacked axis is filled."""
    if missing := sorted(set(tensors) - {u.key for u in plan}):
        raise ConversionError(f"family {family}: no mapping rule for megatron keys {missing}")
    filled: dict[str, set[tuple[int, ...]]] = {}
    for u in plan:
        filled.setdefault(u.key, set()).add(u.prefix)
    for key, prefixes in filled.items():
        n = len(next(iter(prefixes)))
        expected = 1
        for s in tensors[key][:n]:
            expected *= s
        if len(prefixes) != expected:
            raise ConversionError(
                f"family {family}: the rules give {len(prefixes)} of the {expected} tensors stacked in {key} "
                f"{tensors[key][:n]}"
            )


def _checkpoint_model(src: Path, foundation: Any | None) -> tuple[Any, dict]:
    """The model config of a checkpoint (a FoundationConfig, or a composed ModelConfig): the one
    given, else what loong.json records."""
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
    return config_from_meta(meta), meta


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
    fp8_blocks: tuple[int, int] | None = None,
) -> ConvertResult:
    """Convert a Loong / megatron checkpoint (any TP / PP layout) into an HF directory ``out``.
    A LoRA checkpoint (adapters only) is merged into the base weights it names (``W + s * B @ A``):
    the output is a plain model. ``fp8_blocks`` (rows, cols) writes the decoder's projection
    weights FP8 block-quantised, in the layout of the family's release (fp8_blocks.FP8_LAYOUTS)."""
    t0 = time.perf_counter()
    src, out = Path(src), Path(out)
    check_output_dir(out, force)
    if src.name.endswith(PARTIAL_SUFFIX):
        raise ConversionError(f"{src} is an incomplete checkpoint (interrupted save); it cannot be converted")
    meta_path = src / META_FILE
    if meta_path.is_file() and is_diffusion_checkpoint(meta := json.loads(meta_path.read_text())):
        return mcore_to_diffusers(src, out, meta, dtype=dtype, force=force, max_shard_bytes=max_shard_bytes)
    model_cfg, meta = _checkpoint_model(src, foundation)
    verify_files(src, meta)
    cfg = foundation_of(model_cfg)
    lora = meta.get("lora")
    base = _lora_base(src, lora) if lora else src
    if base != src and not is_hf_dir(base):
        verify_files(base, json.loads((base / META_FILE).read_text()))
    out_dtype = parse_dtype(dtype)
    if is_hf_dir(base):  # a LoRA run that started from HF weights
        plan_u, plan, final_dtype, read_group = _hf_base(base, model_cfg, out_dtype)
    else:
        bound = bind_components(model_cfg, meta.get("hf_naming"))
        plan_u, plan, final_dtype, read_group = _mcore_base(base, cfg, bound, out_dtype)
    merge = _LoraMerge(src, lora) if lora else None
    tok_src = tokenizer or base
    with atomic_output_dir(out, force) as tmp:
        def make_writer(p: list) -> SafetensorsWriter:
            return SafetensorsWriter(tmp, p, max_shard_bytes)

        copies = _copies_by_source(cfg)
        plan = _with_copies(plan, copies)
        layout = fp8_layout(cfg.family)
        writer = BlockWriter(make_writer, plan, fp8_blocks, layout) if fp8_blocks else make_writer(plan)
        bar = tqdm(total=len(plan), unit="tensor", desc="mcore-to-hf", disable=not progress)
        try:
            # One read per group: the non-layer tensors, each layer's own tensors, each of its experts.
            for group in _consecutive(plan_u):
                buffers = read_group(group)
                if merge:
                    merge(buffers, group)
                for u in group:
                    keep = u.rule.dtype is not None or out_dtype is None
                    for n, t in zip(u.rule.hf_names(u.layer, u.expert), u.rule.to_hf(buffers[u.key], cfg)):
                        for name in (n, *copies.get(n, ())):
                            writer.write(name, t if keep else t.to(out_dtype))
                        bar.update(1)
            writer.close()
        finally:
            writer.abort()
            bar.close()
        if merge:
            merge.check_all_merged()
        hf_cfg = model_to_hf(model_cfg, final_dtype, meta.get("hf_config"))
        if fp8_blocks:
            hf_cfg["quantization_config"] = layout.config(fp8_blocks)
        copy_tokenizer_files(tok_src, tmp)
        _write_atomic(tmp / CONFIG_FILE, json.dumps(hf_cfg, indent=2) + "\n")
    res = ConvertResult(out, time.perf_counter() - t0, peak_rss_mib(), len(plan))
    logger.info(
        "wrote %s (%d tensors, %.1fs, peak RSS %.0f MiB)", out, len(plan), res.seconds, res.peak_rss_mib
    )
    return res


def verify_files(path: Path, meta: dict) -> None:
    """A checkpoint's files against the SHA-256 its loong.json records (a megatron checkpoint
    without one is read unverified, with a warning)."""
    if "files" not in meta:
        logger.warning("%s records no file hashes: converting it unverified", path)
    elif problems := check_files(path, meta["files"]):
        raise ConversionError(f"{path} failed its integrity check: {'; '.join(problems)}")


def _mcore_base(src: Path, cfg: FoundationConfig, bound: list, out_dtype):
    """(units, HF write plan, output dtype, group -> {key: tensor}) for a megatron checkpoint;
    ``bound``: per component, its rules and the config counting its layers / experts."""
    stored = read_metadata(src)
    where = f"{src} does not match its model config;"
    plan_u = [u for rules, counts in bound for u in plan_units(rules, counts, stored, where)]
    unit_shapes: dict[str, tuple[int, ...]] = {}
    for u in plan_u:
        shape = tuple(stored[u.key].size)
        if len(shape) < len(u.prefix) or any(i >= n for i, n in zip(u.prefix, shape)):
            what = "layers / experts" if u.expert is not None else "layers"
            raise ConversionError(
                f"{src}: {u.key} has shape {shape}, too few {what} for layer {u.layer}"
                + (f" expert {u.expert}" if u.expert is not None else "")
                + f" of the model config ({cfg.num_layers} layers)"
            )
        unit_shapes[u.key] = shape[len(u.prefix) :]
    plan = []
    for u in plan_u:
        dt = out_dtype if out_dtype is not None and u.rule.dtype is None else stored[u.key].properties.dtype
        for n, sh in zip(u.rule.hf_names(u.layer, u.expert), u.rule.hf_shapes(unit_shapes[u.key], cfg)):
            plan.append((n, sh, dt))
    final_dtype = out_dtype or stored[plan_u[0].key].properties.dtype
    return plan_u, plan, final_dtype, (lambda group: _read_units(src, group, unit_shapes, stored))


def _hf_base(src: Path, model_cfg: Any, out_dtype):
    """The same for an HF directory (LoRA base weights), read and mapped to megatron's layout.
    Units are keyed as a uniform decoder stores them (stacked layers)."""
    reader = HFReader(src)
    cfg = foundation_of(model_cfg)
    if not same_model(model_from_hf(reader.config, str(src / CONFIG_FILE)), model_cfg):
        raise ConversionError(f"{src / CONFIG_FILE} (the LoRA base) describes a different model than the checkpoint")
    bound = bind_components(model_cfg, naming_of(model_cfg, set(reader.tensors), str(src)))
    plan_u = [Unit(r, layer, expert, r.mcore, tuple(i for i in (layer, expert) if i is not None))
              for rules, counts in bound for r, layer, expert in units(rules, counts)]  # fmt: skip
    plan = []
    for u in plan_u:
        for n in u.rule.hf_names(u.layer, u.expert):
            if n not in reader:
                raise ConversionError(f"{src}: tensor {n} (for megatron key {u.rule.mcore}) is missing")
            dt = out_dtype if out_dtype is not None and u.rule.dtype is None else reader.info(n).dtype
            plan.append((n, reader.shape(n), dt))
    final_dtype = out_dtype or plan[0][2]
    padded = cfg.padded_vocab_size()

    def read_group(group: list[Unit]) -> dict[str, torch.Tensor]:
        return {u.key: u.rule.to_mcore([reader.read(n) for n in u.rule.hf_names(u.layer, u.expert)], cfg, padded)
                for u in group}  # fmt: skip

    return plan_u, plan, final_dtype, read_group


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
    """Adds ``scale * B @ A`` of a LoRA checkpoint to the base tensors it adapts, group by group.
    An adapter pair is stored like its base weight (same key stem, same stacked layer axis)."""

    def __init__(self, src: Path, lora: dict) -> None:
        self.src, self.scale = src, float(lora["alpha"]) / int(lora["rank"])
        self.stored = read_metadata(src)
        # model tensors only: the optimizer's moments of the adapters share the suffixes
        self.adapted = {k.removesuffix(".lora_a") for k in self.stored if k.endswith(".lora_a")
                        and not k.startswith("optimizer.")}  # fmt: skip
        self.merged: set[str] = set()

    def __call__(self, buffers: dict[str, torch.Tensor], group: list[Unit]) -> None:
        regions, targets = {}, []
        for u in group:
            stem = u.key.removesuffix(".weight")
            if u.expert is not None or stem == u.key or stem not in self.adapted:
                continue
            targets.append((u, stem))
            for k in (stem + ".lora_a", stem + ".lora_b"):
                meta, n = self.stored[k], len(u.prefix)
                shape = tuple(meta.size)
                regions[k] = (u.prefix + (0,) * (len(shape) - n),
                              torch.empty(*(1,) * n, *shape[n:], dtype=meta.properties.dtype))  # fmt: skip
        read_regions(self.src, regions)
        for u, stem in targets:
            n = len(u.prefix)
            a, b = (regions[stem + s][1].reshape(regions[stem + s][1].shape[n:]) for s in (".lora_a", ".lora_b"))
            w = buffers[u.key]
            if (b.shape[0], a.shape[1]) != tuple(w.shape):
                raise ConversionError(f"{self.src}: LoRA {stem} is {tuple(b.shape)} @ {tuple(a.shape)}, "
                                      f"the base weight {tuple(w.shape)}")  # fmt: skip
            buffers[u.key] = (w.float() + self.scale * (b.float() @ a.float())).to(w.dtype)
            self.merged.add(stem)

    def check_all_merged(self) -> None:
        if missed := sorted(self.adapted - self.merged):
            raise ConversionError(f"{self.src}: LoRA adapters without a base weight to merge into: {missed}")


def _consecutive(plan: list[Unit]) -> Iterator[list[Unit]]:
    group: list[Unit] = []
    for u in plan:
        if group and (group[-1].layer, group[-1].expert) != (u.layer, u.expert):
            yield group
            group = []
        group.append(u)
    if group:
        yield group


def _read_units(src: Path, group: list[Unit], unit_shapes, stored) -> dict[str, torch.Tensor]:
    regions = {}
    for u in group:
        shape, dt, n = unit_shapes[u.key], stored[u.key].properties.dtype, len(u.prefix)
        regions[u.key] = (u.prefix + (0,) * len(shape), torch.empty(*(1,) * n, *shape, dtype=dt))
    read_regions(src, regions)
    return {u.key: regions[u.key][1].reshape(unit_shapes[u.key]) for u in group}
