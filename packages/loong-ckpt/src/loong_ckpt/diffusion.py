"""Wan diffusion transformers: diffusers ``WanTransformer3DModel`` and the Wan-AI release's own
layout (``WanModel``: ``blocks.N.self_attn.q``, ``head.head`` ...) <-> Loong ``WanModel``.

The tensors map through the same :class:`~loong_ckpt.mapping.Rule` s as the LLM families
(``WAN_RULES``; per-layer rules use ``{i}``, megatron's keys are indexed ``decoder.layers.<i>.``):
self-attention's q, k, v fuse per head into megatron's ``linear_qkv`` (the ``QKV`` transform with
one query group per head), everything else is one tensor each. Offline conversion streams
tensor by tensor through the same megatron checkpoint writer / reader as :mod:`loong_ckpt.convert`;
the online loader reads each TP rank's slices (``Rule.tp_shard``).

The release layout's rules are the diffusers rules with each tensor renamed through
``DIFFUSERS_TO_WAN`` (the inverse of diffusers' ``convert_wan_transformer_to_diffusers``); a
directory's layout is its config.json's ``_class_name`` (:data:`LAYOUTS`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from loong_ckpt.hf_config import ConversionError
from loong_ckpt.hf_io import CONFIG_FILE, HFReader, SafetensorsWriter
from loong_ckpt.log import logger
from loong_ckpt.mapping import QKV, Rule, Split, locate, units
from loong_models import ModelConfig, WanConfig

WEIGHTS = "diffusion_pytorch_model"  # diffusers' safetensors file stem
CLASS_NAME = "WanTransformer3DModel"
C, R, REP = Split.COLUMN, Split.ROW, Split.REPLICATED


@dataclasses.dataclass(frozen=True)
class WanShapes:
    """What the rules read of a Wan config: layer count, heads (one KV group per head), variants."""

    cfg: WanConfig
    moe: None = None
    vocab_size: int = 0

    @property
    def num_layers(self) -> int:
        return self.cfg.num_layers

    @property
    def num_attention_heads(self) -> int:
        return self.cfg.num_attention_heads

    @property
    def query_groups(self) -> int:
        return self.cfg.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.cfg.attention_head_dim


def _linear(mcore: str, hf: str, split: Split, **kw) -> tuple[Rule, Rule]:
    """weight and bias of a linear; a row-parallel bias is replicated."""
    return (Rule(f"{mcore}.weight", (f"{hf}.weight",), split, **kw),
            Rule(f"{mcore}.bias", (f"{hf}.bias",), C if split is C else REP, **kw))  # fmt: skip


_I2V = {"when": lambda s: s.cfg.image_dim is not None}
_L = "decoder.layers."
_B = "blocks.{i}."

WAN_RULES: tuple[Rule, ...] = (
    *_linear("patch_embedding", "patch_embedding", REP),
    *_linear("time_embedding.linear_1", "condition_embedder.time_embedder.linear_1", REP),
    *_linear("time_embedding.linear_2", "condition_embedder.time_embedder.linear_2", REP),
    *_linear("time_projection", "condition_embedder.time_proj", C),
    *_linear("text_embedding.linear_fc1", "condition_embedder.text_embedder.linear_1", C),
    *_linear("text_embedding.linear_fc2", "condition_embedder.text_embedder.linear_2", R),
    *_linear("image_norm1", "condition_embedder.image_embedder.norm1", REP, **_I2V),
    *_linear("image_embedding.linear_fc1", "condition_embedder.image_embedder.ff.net.0.proj", C, **_I2V),
    *_linear("image_embedding.linear_fc2", "condition_embedder.image_embedder.ff.net.2", R, **_I2V),
    *_linear("image_norm2", "condition_embedder.image_embedder.norm2", REP, **_I2V),
    Rule("head.modulation", ("scale_shift_table",), REP),
    *_linear("head.linear", "proj_out", REP),
    # layers
    *(Rule(f"{_L}self_attention.linear_qkv.{p}", tuple(f"{_B}attn1.to_{x}.{p}" for x in "qkv"), C, QKV)
      for p in ("weight", "bias")),  # fmt: skip
    Rule(f"{_L}self_attention.q_norm.weight", (f"{_B}attn1.norm_q.weight",), C),
    Rule(f"{_L}self_attention.k_norm.weight", (f"{_B}attn1.norm_k.weight",), C),
    *_linear(f"{_L}self_attention.linear_proj", f"{_B}attn1.to_out.0", R),
    *_linear(f"{_L}cross_attention.linear_q", f"{_B}attn2.to_q", C),
    *_linear(f"{_L}cross_attention.linear_k", f"{_B}attn2.to_k", C),
    *_linear(f"{_L}cross_attention.linear_v", f"{_B}attn2.to_v", C),
    Rule(f"{_L}cross_attention.q_norm.weight", (f"{_B}attn2.norm_q.weight",), C),
    Rule(f"{_L}cross_attention.k_norm.weight", (f"{_B}attn2.norm_k.weight",), C),
    *_linear(f"{_L}cross_attention.linear_proj", f"{_B}attn2.to_out.0", R),
    *_linear(f"{_L}cross_attention.linear_k_img", f"{_B}attn2.add_k_proj", C, **_I2V),
    *_linear(f"{_L}cross_attention.linear_v_img", f"{_B}attn2.add_v_proj", C, **_I2V),
    Rule(f"{_L}cross_attention.k_img_norm.weight", (f"{_B}attn2.norm_added_k.weight",), C, **_I2V),
    *_linear(f"{_L}cross_norm", f"{_B}norm2", REP, when=lambda s: s.cfg.cross_attn_norm),
    *_linear(f"{_L}mlp.linear_fc1", f"{_B}ffn.net.0.proj", C),
    *_linear(f"{_L}mlp.linear_fc2", f"{_B}ffn.net.2", R),
    Rule(f"{_L}modulation", (f"{_B}scale_shift_table",), REP),
)


# diffusers module -> the Wan-AI release's module ({i}: the block). Both name a tensor as module +
# ".weight" / ".bias", except the modulation tables, which are tensors themselves.
DIFFUSERS_TO_WAN: tuple[tuple[str, str], ...] = (
    ("patch_embedding", "patch_embedding"),
    ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
    ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    ("condition_embedder.time_proj", "time_projection.1"),
    ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
    ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    ("condition_embedder.image_embedder.norm1", "img_emb.proj.0"),
    ("condition_embedder.image_embedder.ff.net.0.proj", "img_emb.proj.1"),
    ("condition_embedder.image_embedder.ff.net.2", "img_emb.proj.3"),
    ("condition_embedder.image_embedder.norm2", "img_emb.proj.4"),
    ("scale_shift_table", "head.modulation"),
    ("proj_out", "head.head"),
    *((f"{_B}attn1.{d}", f"{_B}self_attn.{w}") for d, w in (
        ("to_q", "q"), ("to_k", "k"), ("to_v", "v"), ("to_out.0", "o"), ("norm_q", "norm_q"), ("norm_k", "norm_k"))),
    *((f"{_B}attn2.{d}", f"{_B}cross_attn.{w}") for d, w in (
        ("to_q", "q"), ("to_k", "k"), ("to_v", "v"), ("to_out.0", "o"), ("norm_q", "norm_q"), ("norm_k", "norm_k"),
        ("add_k_proj", "k_img"), ("add_v_proj", "v_img"), ("norm_added_k", "norm_k_img"))),
    (f"{_B}norm2", f"{_B}norm3"),  # the cross-attention LayerNorm (Wan orders its norms 1, 3, 2)
    (f"{_B}ffn.net.0.proj", f"{_B}ffn.0"),
    (f"{_B}ffn.net.2", f"{_B}ffn.2"),
    (f"{_B}scale_shift_table", f"{_B}modulation"),
)  # fmt: skip


def wan_release_name(name: str) -> str:
    """The Wan-AI release's name of a diffusers tensor name (with ``{i}`` for the block)."""
    for d, w in DIFFUSERS_TO_WAN:
        if name == d or name.startswith(d + "."):
            return w + name[len(d) :]
    raise ValueError(f"no Wan release name for diffusers tensor {name!r} (DIFFUSERS_TO_WAN)")


WAN_RELEASE_RULES: tuple[Rule, ...] = tuple(
    dataclasses.replace(r, hf=tuple(wan_release_name(n) for n in r.hf)) for r in WAN_RULES
)


def wan_rules(cfg: WanConfig, layout: str = "diffusers") -> tuple[list[Rule], WanShapes]:
    shapes = WanShapes(cfg)
    return [r for r in LAYOUTS[layout].rules if r.applies(shapes)], shapes


# --- config.json <-> WanConfig ------------------------------------------------------------------

_SAME = ("num_layers", "num_attention_heads", "attention_head_dim", "ffn_dim", "in_channels", "out_channels",
         "text_dim", "freq_dim", "eps", "cross_attn_norm", "image_dim", "rope_max_seq_len")  # fmt: skip


def wan_from_diffusers(hf: dict[str, Any], source: str) -> WanConfig:
    """A WanConfig from a diffusers config.json; variants Loong does not build raise naming the key."""
    if hf.get("_class_name") != CLASS_NAME:
        raise ConversionError(f"{source}: _class_name={hf.get('_class_name')!r}, expected {CLASS_NAME!r}")
    if hf.get("qk_norm", "rms_norm_across_heads") != "rms_norm_across_heads":
        raise ConversionError(f"{source}: qk_norm={hf['qk_norm']!r}; supported: 'rms_norm_across_heads'")
    if hf.get("pos_embed_seq_len") is not None:
        raise ConversionError(f"{source}: pos_embed_seq_len={hf['pos_embed_seq_len']} (FLF2V) is not supported")
    dim = hf["num_attention_heads"] * hf["attention_head_dim"]
    if hf.get("added_kv_proj_dim") not in (None, dim) or (hf.get("added_kv_proj_dim") is None) != (hf.get("image_dim") is None):
        raise ConversionError(f"{source}: added_kv_proj_dim={hf.get('added_kv_proj_dim')} must be the model width "
                              f"{dim} with image_dim set (Wan2.1 I2V), or both null")  # fmt: skip
    try:
        fields = {k: hf[k] for k in _SAME if k in hf}
        cfg = WanConfig(patch_size=list(hf.get("patch_size", [1, 2, 2])), **fields)
        cfg.validate()
    except (ValueError, TypeError) as e:
        raise ConversionError(f"{source}: {e}") from None
    return cfg


def wan_to_diffusers(cfg: WanConfig, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """diffusers config.json of ``cfg``; ``base`` (the source config) is kept if it describes it."""
    if base is not None and _describes(base, cfg, lambda b: wan_from_diffusers(b, "config.json")):
        return dict(base)
    out = {"_class_name": CLASS_NAME, "patch_size": list(cfg.patch_size), "qk_norm": "rms_norm_across_heads",
           "added_kv_proj_dim": cfg.dim if cfg.image_dim is not None else None, "pos_embed_seq_len": None}  # fmt: skip
    out.update({k: getattr(cfg, k) for k in _SAME})
    return out


RELEASE_CLASS = "WanModel"
_RELEASE_KINDS = ("t2v", "i2v", "ti2v")  # FLF2V (image position embedding) and VACE are not built


def wan_from_release(hf: dict[str, Any], source: str, image_dim: int | None = None) -> WanConfig:
    """A WanConfig from a Wan-AI release's config.json (``WanModel``); ``image_dim``: the CLIP
    width of an I2V model's image projection, read from its weights (1280 in the releases)."""
    if hf.get("_class_name") != RELEASE_CLASS:
        raise ConversionError(f"{source}: _class_name={hf.get('_class_name')!r}, expected {RELEASE_CLASS!r}")
    kind = hf.get("model_type", "t2v")
    if kind not in _RELEASE_KINDS:
        raise ConversionError(f"{source}: model_type={kind!r} is not supported; supported: {', '.join(_RELEASE_KINDS)}")
    if not hf.get("qk_norm", True) or list(hf.get("window_size", [-1, -1])) != [-1, -1]:
        raise ConversionError(f"{source}: qk_norm={hf.get('qk_norm')} / window_size={hf.get('window_size')}: "
                              "Loong builds Wan with q/k norm and global attention (true, [-1, -1])")  # fmt: skip
    if hf["dim"] % hf["num_heads"]:
        raise ConversionError(f"{source}: dim={hf['dim']} is not a multiple of num_heads={hf['num_heads']}")
    try:
        cfg = WanConfig(num_layers=hf["num_layers"], num_attention_heads=hf["num_heads"],
                        attention_head_dim=hf["dim"] // hf["num_heads"], ffn_dim=hf["ffn_dim"],
                        in_channels=hf["in_dim"], out_channels=hf["out_dim"],
                        patch_size=list(hf.get("patch_size", [1, 2, 2])), text_dim=hf.get("text_dim", 4096),
                        text_len=hf.get("text_len", 512), freq_dim=hf.get("freq_dim", 256), eps=hf.get("eps", 1e-6),
                        cross_attn_norm=hf.get("cross_attn_norm", True),
                        image_dim=(image_dim or 1280) if kind == "i2v" else None)  # fmt: skip
        cfg.validate()
    except (ValueError, TypeError, KeyError) as e:
        raise ConversionError(f"{source}: {e!r}") from None
    return cfg


def wan_to_release(cfg: WanConfig, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """The release's config.json of ``cfg``; ``base`` (the source config) is kept if it describes it."""
    read = lambda b: wan_from_release(b, "config.json", cfg.image_dim)  # noqa: E731
    if base is not None and base.get("_class_name") == RELEASE_CLASS and _describes(base, cfg, read):
        return dict(base)
    return {"_class_name": RELEASE_CLASS, "model_type": "t2v" if cfg.image_dim is None else "i2v", "dim": cfg.dim,
            "eps": cfg.eps, "ffn_dim": cfg.ffn_dim, "freq_dim": cfg.freq_dim, "in_dim": cfg.in_channels,
            "num_heads": cfg.num_attention_heads, "num_layers": cfg.num_layers, "out_dim": cfg.out_channels,
            "text_len": cfg.text_len, "text_dim": cfg.text_dim, "patch_size": list(cfg.patch_size),
            "cross_attn_norm": cfg.cross_attn_norm, "qk_norm": True, "window_size": [-1, -1]}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class WanLayout:
    """A Wan checkpoint layout: its config class, tensor names (rules) and config reader / writer."""

    name: str
    class_name: str
    image_weight: str  # the I2V image projection's first tensor ([image_dim]): its width
    read_config: Callable[[dict[str, Any], str, int | None], WanConfig]
    write_config: Callable[[WanConfig, dict[str, Any] | None], dict[str, Any]]

    @property
    def rules(self) -> tuple[Rule, ...]:
        return WAN_RULES if self.name == "diffusers" else WAN_RELEASE_RULES


LAYOUTS: dict[str, WanLayout] = {
    "diffusers": WanLayout("diffusers", CLASS_NAME, "condition_embedder.image_embedder.norm1.weight",
                           lambda hf, src, _dim: wan_from_diffusers(hf, src), wan_to_diffusers),
    "wan": WanLayout("wan", RELEASE_CLASS, "img_emb.proj.0.weight", wan_from_release, wan_to_release),
}  # fmt: skip


def layout_of(hf: dict[str, Any] | None) -> WanLayout | None:
    """The layout a config.json describes (by ``_class_name``), None for another model."""
    return next((lay for lay in LAYOUTS.values() if (hf or {}).get("_class_name") == lay.class_name), None)


def is_wan_dir(path: str | Path) -> bool:
    """A diffusers or Wan-release transformer directory (by its config.json)."""
    cfg = Path(path) / CONFIG_FILE
    return cfg.is_file() and layout_of(json.loads(cfg.read_text())) is not None


def _read_wan(reader: HFReader, source: str) -> tuple[WanConfig, WanLayout]:
    layout = layout_of(reader.config)
    if layout is None:
        raise ConversionError(f"{source}: _class_name={reader.config.get('_class_name')!r}, expected "
                              f"{' or '.join(repr(x.class_name) for x in LAYOUTS.values())}")  # fmt: skip
    dim = reader.shape(layout.image_weight)[0] if layout.image_weight in reader else None
    return layout.read_config(reader.config, source, dim), layout


def _arch(cfg: WanConfig) -> dict[str, Any]:
    return {k: getattr(cfg, k) for k in (*_SAME, "patch_size")}


def _describes(base: dict[str, Any], cfg: WanConfig, read: Callable[[dict[str, Any]], WanConfig]) -> bool:
    """Whether the source config ``base`` (parsed by ``read``) has ``cfg``'s architecture, so that an
    export can keep it; one that does not parse does not (the export writes a fresh config)."""
    try:
        return _arch(read(base)) == _arch(cfg)
    except (ConversionError, KeyError):
        return False


# --- the model's checkpoint template ----------------------------------------------------------


def wan_template(cfg: WanConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint keys -> global shapes of the WanModel loong_models builds (on the meta device)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from loong_ckpt.mcore_io import _single_process_megatron
    from loong_models import build_model, build_transformer_config

    with _single_process_megatron():
        base = build_transformer_config(ModelConfig().foundation, use_cpu_initialization=True,
                                        perform_initialization=False, params_dtype=torch.float32)  # fmt: skip
        with torch.device("meta"):
            model = build_model(ModelConfig(diffusion=cfg, layer_backend="local"), base, device_type="cpu")
        sd = model.sharded_state_dict()
    return {sh.key: tuple(sh.global_shape) for sh in sd.values() if isinstance(sh, ShardedTensor)}


def plan(cfg: WanConfig, keys: dict[str, tuple[int, ...]], where: str, layout: str = "diffusers") -> list:
    """Every (rule, layer) tensor of ``cfg`` located among checkpoint ``keys``; the rules must
    cover every key exactly."""
    rules, shapes = wan_rules(cfg, layout)
    out = []
    for rule, layer, _ in units(rules, shapes):
        u = locate(rule, layer, None, keys)
        if u is None:
            raise ConversionError(f"{where}: no tensor {rule.mcore} (layer {layer})")
        out.append(u)
    if missing := sorted(set(keys) - {u.key for u in out}):
        raise ConversionError(f"{where}: no Wan mapping rule for megatron keys {missing[:6]}")
    return out


# --- offline -------------------------------------------------------------------------------------


def diffusers_to_mcore(src: str | Path, out: str | Path, *, dtype: str | None = None, force: bool = False,
                       progress: bool = True):  # fmt: skip
    """A diffusers ``transformer/`` directory or a Wan-AI release directory -> a Loong checkpoint
    directory (global tensors, loadable at any TP size) with ``loong.json`` recording the model."""
    from loong_ckpt.mcore_io import Chunk, write_checkpoint
    from loong_ckpt.output import (
        ConvertResult,
        atomic_output_dir,
        check_output_dir,
        parse_dtype,
        peak_rss_mib,
    )
    from loong_ckpt.training import FORMAT_VERSION, META_FILE, _write_atomic

    t0 = time.perf_counter()
    src, out = Path(src), Path(out).absolute()
    check_output_dir(out, force)
    reader = HFReader(src, WEIGHTS)
    cfg, layout = _read_wan(reader, str(src / CONFIG_FILE))
    template = wan_template(cfg)
    units_ = plan(cfg, template, f"{src}", layout.name)
    _, shapes = wan_rules(cfg, layout.name)
    for u in units_:
        for name, want in zip(u.rule.hf_names(u.layer), u.rule.hf_shapes(template[u.key], shapes)):
            if name not in reader:
                raise ConversionError(f"{src}: tensor {name} (for megatron key {u.key}) is missing")
            if reader.shape(name) != want:
                raise ConversionError(f"{src / CONFIG_FILE} does not match the weights: {name} has shape "
                                      f"{reader.shape(name)}, the config implies {want} (megatron key {u.key})")  # fmt: skip
    out_dtype = parse_dtype(dtype) or reader.info(units_[0].rule.hf_names(units_[0].layer)[0]).dtype
    by_key = {u.key: u for u in units_}
    chunks = [Chunk(k, s, (0,) * len(s), s, out_dtype) for k, s in template.items()]
    bar = tqdm(total=len(chunks), unit="tensor", desc="diffusers-to-mcore", disable=not progress)

    def compute(chunk: Chunk) -> torch.Tensor:
        u = by_key[chunk.key]
        bar.update(1)
        return u.rule.to_mcore([reader.read(n) for n in u.rule.hf_names(u.layer)], shapes, 0)

    with atomic_output_dir(out, force) as tmp:
        write_checkpoint(tmp, chunks, [], compute)
        bar.close()
        meta = {"format_version": FORMAT_VERSION, "step": 0, "layout": None, "time": time.time(),
                "model": {"diffusion": dataclasses.asdict(cfg)}, "hf_config": reader.config,
                "source": {"hf_dir": str(src.absolute()), "converter": "loong-convert hf-to-mcore"}}  # fmt: skip
        _write_atomic(tmp / META_FILE, json.dumps(meta, indent=2))
    res = ConvertResult(out, time.perf_counter() - t0, peak_rss_mib(), len(chunks))
    logger.info("wrote %s (%d tensors, %.1fs)", out, len(chunks), res.seconds)
    return res


def mcore_to_diffusers(src: str | Path, out: str | Path, meta: dict[str, Any], *, dtype: str | None = None,
                       force: bool = False, max_shard_bytes: int = 2 * 2**30, layout: str | None = None):  # fmt: skip
    """A Loong checkpoint of a Wan model (any TP layout) -> a diffusers ``transformer/`` directory,
    or the Wan-AI release layout (``layout="wan"``; default: the layout the run started from)."""
    from loong_ckpt.mcore_io import read_metadata, read_regions
    from loong_ckpt.output import ConvertResult, atomic_output_dir, parse_dtype, peak_rss_mib

    t0 = time.perf_counter()
    src, out = Path(src), Path(out).absolute()
    cfg = wan_config_from_meta(meta, str(src))
    lay = LAYOUTS[layout] if layout else (layout_of(meta.get("hf_config")) or LAYOUTS["diffusers"])
    stored = read_metadata(src)
    keys = {k: tuple(v.size) for k, v in stored.items() if not k.startswith("optimizer.")}
    units_ = plan(cfg, keys, str(src), lay.name)
    _, shapes = wan_rules(cfg, lay.name)
    out_dtype = parse_dtype(dtype)
    order = []
    for u in units_:
        for name, shape in zip(u.rule.hf_names(u.layer), u.rule.hf_shapes(tuple(stored[u.key].size), shapes)):
            order.append((name, shape, out_dtype or stored[u.key].properties.dtype, u))
    with atomic_output_dir(out, force) as tmp:
        writer = SafetensorsWriter(tmp, [(n, s, d) for n, s, d, _ in order], max_shard_bytes, WEIGHTS)
        done: dict[str, torch.Tensor] = {}
        for name, _, dt, u in order:
            if name not in done:
                buf = torch.empty(tuple(stored[u.key].size), dtype=stored[u.key].properties.dtype)
                read_regions(src, {u.key: ((0,) * buf.dim(), buf)})
                done.update(zip(u.rule.hf_names(u.layer), u.rule.to_hf(buf, shapes)))
            writer.write(name, done.pop(name).to(dt))
        writer.close()
        (tmp / CONFIG_FILE).write_text(json.dumps(lay.write_config(cfg, meta.get("hf_config")), indent=2) + "\n")
    return ConvertResult(out, time.perf_counter() - t0, peak_rss_mib(), len(order))


def wan_config_from_meta(meta: dict[str, Any], where: str) -> WanConfig:
    raw = (meta.get("model") or {}).get("diffusion")
    if raw is None:
        raise ConversionError(f"{where}: loong.json records no diffusion model ('model.diffusion')")
    from omegaconf import OmegaConf

    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(WanConfig), raw))


def is_diffusion_checkpoint(meta: dict[str, Any]) -> bool:
    return bool((meta.get("model") or {}).get("diffusion"))


# --- online --------------------------------------------------------------------------------------


def load_diffusers_weights(path: str | Path, chunks: list[torch.nn.Module], cfg: WanConfig) -> int:
    """Load a diffusers (or Wan-AI release) Wan directory into this rank's model ``chunks``: each
    tensor-parallel rank reads only its slices. ``cfg`` must describe the same architecture (the
    error lists keys)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from loong_ckpt.mapping import rule_key
    from loong_ckpt.training import _unwrap

    reader = HFReader(path, WEIGHTS)
    hf_cfg, layout = _read_wan(reader, str(Path(path) / CONFIG_FILE))
    if diff := [f"diffusion.{k}: {v!r} (HF) != {_arch(cfg)[k]!r}" for k, v in _arch(hf_cfg).items() if _arch(cfg)[k] != v]:
        raise ConversionError(f"{Path(path) / CONFIG_FILE} describes a different model: {'; '.join(diff)}")
    rules, shapes = wan_rules(cfg, layout.name)
    by_key = {r.mcore: r for r in rules}
    rank, size = mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size()
    loaded = 0
    for chunk in chunks:
        for name, sh in _unwrap(chunk).sharded_state_dict().items():
            if not isinstance(sh, ShardedTensor):
                continue
            key, layer = rule_key(sh.key)
            rule = by_key.get(key)
            if rule is None:
                raise ConversionError(f"Wan: no mapping rule for megatron key {sh.key}")
            whole = tuple(sh.data.shape) == tuple(sh.global_shape)
            local = rule.tp_shard(reader, layer, shapes, 0 if whole else rank, 1 if whole else size, 0)
            if local.shape != sh.data.shape:
                raise ConversionError(f"{path}: {rule.hf_names(layer)} give {tuple(local.shape)} for {name}, "
                                      f"the model holds {tuple(sh.data.shape)} on this rank")  # fmt: skip
            with torch.no_grad():
                sh.data.copy_(local)
            loaded += 1
    logger.info("loaded %d tensors from diffusers directory %s", loaded, path)
    return loaded
