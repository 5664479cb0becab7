"""Pi0.5 weights: LeRobot / OpenPI (PyTorch) checkpoints <-> Loong's ``Pi05Policy``.

The mapping is a declaration (:data:`RULES`): one Loong parameter name per checkpoint name,
``{i}`` the layer index. Checkpoint names are OpenPI's PyTorch layout
(``paligemma_with_expert.paligemma.model.language_model.layers.{i}...``); LeRobot's
``PI05Policy`` prefixes them with ``model.`` (:data:`LEROBOT_PREFIX`). Reading accepts both
SigLIP layouts (transformers 4's ``vision_tower.vision_model.*``, as the released checkpoints
have it, and transformers 5's ``vision_tower.*``), and the VLM embedding stored only as the
tied ``paligemma.lm_head.weight``. Tensors Pi0.5 never uses are skipped on reading and not
written: the LM heads (the VLM's is tied to its embedding, the expert's is dead) and SigLIP's
pooling head.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from loong_models.embodied.pi05 import Pi05Config

LEROBOT_PREFIX = "model."
_PG = "paligemma_with_expert.paligemma.model."
_VT = _PG + "vision_tower.vision_model."
_LM = _PG + "language_model."
_EX = "paligemma_with_expert.gemma_expert.model."

_GEMMA = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
          "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")  # fmt: skip
_SIGLIP = ("layer_norm1", "layer_norm2", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
           "self_attn.out_proj", "mlp.fc1", "mlp.fc2")  # fmt: skip


def _loong_gemma(name: str) -> str:
    return name.replace("self_attn.", "")


RULES: tuple[tuple[str, str], ...] = (
    ("vision.patch_embedding.weight", _VT + "embeddings.patch_embedding.weight"),
    ("vision.patch_embedding.bias", _VT + "embeddings.patch_embedding.bias"),
    ("vision.position_embedding.weight", _VT + "embeddings.position_embedding.weight"),
    *((f"vision.layers.{{i}}.{m.split('.')[-1]}.{p}", f"{_VT}encoder.layers.{{i}}.{m}.{p}")
      for m in _SIGLIP for p in ("weight", "bias")),
    ("vision.post_layernorm.weight", _VT + "post_layernorm.weight"),
    ("vision.post_layernorm.bias", _VT + "post_layernorm.bias"),
    ("projector.weight", _PG + "multi_modal_projector.linear.weight"),
    ("projector.bias", _PG + "multi_modal_projector.linear.bias"),
    ("embed_tokens.weight", _LM + "embed_tokens.weight"),
    *((f"layers.{{i}}.vlm.{_loong_gemma(n)}", f"{_LM}layers.{{i}}.{n}") for n in _GEMMA),
    ("layers.{i}.vlm.input_layernorm.weight", _LM + "layers.{i}.input_layernorm.weight"),
    ("layers.{i}.vlm.post_attention_layernorm.weight", _LM + "layers.{i}.post_attention_layernorm.weight"),
    ("vlm_norm.weight", _LM + "norm.weight"),
    *((f"layers.{{i}}.expert.{_loong_gemma(n)}", f"{_EX}layers.{{i}}.{n}") for n in _GEMMA),
    *((f"layers.{{i}}.expert.{norm}.dense.{p}", f"{_EX}layers.{{i}}.{norm}.dense.{p}")
      for norm in ("input_layernorm", "post_attention_layernorm") for p in ("weight", "bias")),
    ("expert_norm.dense.weight", _EX + "norm.dense.weight"),
    ("expert_norm.dense.bias", _EX + "norm.dense.bias"),
    *((f"{m}.{p}", f"{m}.{p}") for m in ("action_in_proj", "action_out_proj", "time_mlp_in", "time_mlp_out")
      for p in ("weight", "bias")),
)  # fmt: skip

# Checkpoint tensors Pi0.5 does not use (see the module docstring).
UNUSED = re.compile(r"(^|\.)lm_head\.weight$|vision_tower\.(vision_model\.)?head\.")
_TIED_EMBEDDING = "paligemma_with_expert.paligemma.lm_head.weight"
# transformers 5 writes SigLIP without the vision_model level
_VISION_V5 = re.compile(r"vision_tower\.(?!vision_model\.)")


def _expand(cfg: Pi05Config) -> list[tuple[str, str]]:
    pairs = []
    for loong, ckpt in RULES:
        if "{i}" not in loong:
            pairs.append((loong, ckpt))
            continue
        depth = cfg.vision.num_layers if loong.startswith("vision.") else cfg.vlm.depth
        pairs += [(loong.replace("{i}", str(i)), ckpt.replace("{i}", str(i))) for i in range(depth)]
    return pairs


def _normalise(state: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """Drop the LeRobot prefix, restore ``vision_model.``, recover a tied-only embedding."""
    if state and all(k.startswith(LEROBOT_PREFIX) for k in state):
        state = {k[len(LEROBOT_PREFIX) :]: v for k, v in state.items()}
    state = {_VISION_V5.sub("vision_tower.vision_model.", k): v for k, v in state.items()}
    if _LM + "embed_tokens.weight" not in state and _TIED_EMBEDDING in state:
        state[_LM + "embed_tokens.weight"] = state[_TIED_EMBEDDING]
    return state


def from_lerobot(
    state: dict[str, torch.Tensor], cfg: Pi05Config, source: str = "checkpoint"
) -> dict[str, torch.Tensor]:
    """A LeRobot / OpenPI Pi0.5 state dict -> ``Pi05Policy``'s; errors name the first missing or
    unexpected tensor of ``source``."""
    state = _normalise(state, source)
    pairs = _expand(cfg)
    missing = [c for _, c in pairs if c not in state]
    if missing:
        raise KeyError(f"{source}: no tensor {missing[0]!r} (expected for {cfg.vlm.depth} Gemma layers and "
                       f"{cfg.vision.num_layers} SigLIP layers; {len(missing)} missing)")  # fmt: skip
    known = {c for _, c in pairs} | {_TIED_EMBEDDING}
    extra = [k for k in state if k not in known and not UNUSED.search(k)]
    if extra:
        raise KeyError(f"{source}: unexpected tensor {extra[0]!r} for Pi0.5 ({len(extra)} unexpected)")
    return {loong: state[ckpt] for loong, ckpt in pairs}


def to_lerobot(
    state: dict[str, torch.Tensor], cfg: Pi05Config, prefix: str = LEROBOT_PREFIX
) -> dict[str, torch.Tensor]:
    """``Pi05Policy``'s state dict -> LeRobot's (``prefix="model."``) or OpenPI's (``prefix=""``)."""
    pairs = _expand(cfg)
    missing = [loong for loong, _ in pairs if loong not in state]
    if missing:
        raise KeyError(f"Pi05Policy state dict: no tensor {missing[0]!r}")
    return {prefix + ckpt: state[loong] for loong, ckpt in pairs}


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors file, or of every ``*.safetensors`` file in a directory."""
    from safetensors.torch import load_file

    path = Path(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors file")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


# --- files: LeRobot safetensors <-> Loong (megatron) checkpoints, offline and in a run ----------


def config_from_meta(meta: dict) -> Pi05Config:
    from omegaconf import OmegaConf

    if "embodied" not in meta:
        raise ValueError("the checkpoint's loong.json records no 'embodied' model: not a Pi0.5 checkpoint")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Pi05Config), meta["embodied"]))


def read_checkpoint_weights(checkpoint: str | Path) -> tuple[dict[str, torch.Tensor], Pi05Config]:
    """A Loong Pi0.5 checkpoint's weights (whole tensors, fp32 as stored) and config, read without
    process groups (safe on one rank of a running job)."""
    from loong_ckpt.mcore_io import read_metadata, read_regions
    from loong_ckpt.training import read_checkpoint_info

    info = read_checkpoint_info(checkpoint)
    cfg = config_from_meta(info.meta)
    stored = read_metadata(info.path)
    names = [loong for loong, _ in _expand(cfg)]
    missing = [n for n in names if n not in stored]
    if missing:
        raise KeyError(f"{info.path}: no tensor {missing[0]!r} for the recorded Pi0.5 config")
    regions = {n: ((0,) * len(stored[n].size), torch.empty(tuple(stored[n].size), dtype=stored[n].properties.dtype))
               for n in names}  # fmt: skip
    read_regions(info.path, regions)
    return {n: buf for n, (_, buf) in regions.items()}, cfg


def mcore_to_lerobot(checkpoint: str | Path, out: str | Path, *, prefix: str = LEROBOT_PREFIX) -> Path:
    """Write ``out/model.safetensors`` (LeRobot names; ``prefix=""``: OpenPI's) and ``out/config.json``
    (the Loong Pi0.5 config) from a Loong checkpoint."""
    import dataclasses
    import json

    from safetensors.torch import save_file

    state, cfg = read_checkpoint_weights(checkpoint)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in to_lerobot(state, cfg, prefix).items()}, str(out / "model.safetensors")
    )
    (out / "config.json").write_text(json.dumps({"type": "pi05", "loong": dataclasses.asdict(cfg)}, indent=2))
    return out


def load_lerobot_weights(path: str | Path, chunks: list[torch.nn.Module], cfg: Pi05Config) -> None:
    """Online import: a LeRobot / OpenPI checkpoint's weights into the (DDP-wrapped) policy chunks."""
    state = from_lerobot(read_safetensors(path), cfg, source=str(path))
    for chunk in chunks:
        while hasattr(chunk, "module"):
            chunk = chunk.module
        with torch.no_grad():
            for name, t in chunk.state_dict().items():
                t.copy_(state[name])


def lerobot_to_mcore(src: str | Path, out_root: str | Path, cfg: Pi05Config) -> Path:
    """Offline: a LeRobot / OpenPI checkpoint -> a Loong checkpoint (``out_root/step_00000000``)
    that ``train.init_from`` takes."""
    import dataclasses

    from loong_ckpt.mcore_io import _single_process_megatron
    from loong_ckpt.training import save_checkpoint
    from loong_models.embodied import Pi05Policy

    policy = Pi05Policy(cfg)
    load_lerobot_weights(src, [policy], cfg)
    with _single_process_megatron():
        return save_checkpoint(out_root, 0, [policy], extra={"embodied": dataclasses.asdict(cfg)})
