"""Online HF I/O for a running job: load HF weights straight into model chunks, export HF weights.

Loading: every rank walks its own chunks' ``sharded_state_dict()`` (so only its pipeline stage's
layers, and only its expert-parallel rank's experts, named by their global expert ids), finds each
key's rule and reads only the slices its tensor-parallel rank holds (``safetensors``
``get_slice``; expert tensors by the expert-tensor-parallel rank), then copies them into the
parameters.

Exporting: the job's megatron checkpoint already holds global tensors, so rank 0 converts the
checkpoint just saved (streaming, bounded memory) while the other ranks wait; no weights are
gathered through the process group.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from loong_ckpt.components import (
    bind,
    component_diff,
    foundation_of,
    is_composed,
    mapping_of,
    model_from_hf,
    naming_of,
    same_model,
)
from loong_ckpt.hf_config import ConversionError
from loong_ckpt.hf_io import CONFIG_FILE, HFReader, is_hf_dir
from loong_ckpt.log import logger
from loong_ckpt.mapping import rule_key
from loong_ckpt.training import _unwrap
from loong_models import FoundationConfig
from loong_models.lora import is_adapter_key

__all__ = ["export_hf", "is_hf_dir", "load_hf_weights", "read_hf_foundation", "read_hf_model"]


def read_hf_model(path: str | Path) -> Any:
    """The Loong config of an HF directory (from its config.json): a FoundationConfig for a text
    family, a ModelConfig (image encoder, projector, foundation) for a composed architecture."""
    return model_from_hf(HFReader.read_config(Path(path)), str(Path(path) / CONFIG_FILE))


def read_hf_foundation(path: str | Path) -> FoundationConfig:
    """The foundation config of an HF directory (from its config.json)."""
    return foundation_of(read_hf_model(path))


def load_hf_weights(path: str | Path, chunks: list[torch.nn.Module], cfg: Any) -> int:
    """Load an HF directory's weights into this rank's model ``chunks`` (built for ``cfg``: a
    FoundationConfig or a ModelConfig; a composed model needs its ModelConfig).
    Returns the number of parameters tensors loaded. LoRA adapters are not HF weights: they keep
    their initialisation."""
    from megatron.core import parallel_state as mpu
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensorFactory

    from loong_ckpt.convert import check_hf_extras

    reader = HFReader(path)
    hf_cfg = model_from_hf(reader.config, str(Path(path) / CONFIG_FILE))
    model_cfg = cfg if is_composed(cfg) else foundation_of(cfg)  # a text-only ModelConfig works too
    cfg = foundation_of(model_cfg)
    if not same_model(hf_cfg, model_cfg):
        raise ConversionError(
            f"{Path(path) / CONFIG_FILE} describes a different model than model.foundation: "
            f"{_diff(hf_cfg, model_cfg)}"
        )
    check_hf_extras(reader, cfg)
    what = mapping_of(model_cfg).name if is_composed(model_cfg) else cfg.family
    naming = naming_of(model_cfg, set(reader.tensors), str(path))
    rules = {k: r for r in bind(model_cfg, naming) for k in (r.mcore, *r.aliases)}
    tp = mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size()
    etp = mpu.get_expert_tensor_parallel_rank(), mpu.get_expert_tensor_parallel_world_size()
    padded = cfg.padded_vocab_size(tp[1])
    loaded = 0
    for chunk in chunks:
        for name, entry in _unwrap(chunk).sharded_state_dict().items():
            if isinstance(entry, ShardedObject) or is_adapter_key(name):
                continue
            data = entry.data
            sh = entry.build()[0] if isinstance(entry, ShardedTensorFactory) else entry
            key, layer = rule_key(sh.key)
            rule = rules.get(key)
            if rule is None:
                raise ConversionError(
                    f"family {what}: no mapping rule for megatron key {sh.key} ({name})"
                )
            axis = 0  # the prepended axes: the stacked layer (unless the key is indexed), then the expert
            if rule.layered and layer is None:
                layer, axis = sh.global_offset[0], 1
            expert = sh.global_offset[axis] if rule.expert else None
            rank, size = etp if rule.expert else tp
            dim = rule.split.dim
            if dim is not None and sh.axis_fragmentations[sh.prepend_axis_num + dim] == 1:
                rank, size = (
                    0,
                    1,
                )  # a linear this layer spec keeps whole on every rank (TE's MLA down projections)
            if tuple(data.shape) == tuple(sh.global_shape[sh.prepend_axis_num :]):
                rank, size = 0, 1  # the whole tensor on every rank (an image encoder at TP=1 in TP=2)
            local = rule.tp_shard(reader, layer, cfg, rank, size, padded, expert)
            if local.shape != data.shape:
                raise ConversionError(
                    f"{path}: {', '.join(rule.hf_names(layer, expert))} give {tuple(local.shape)} for {name}, "
                    f"the model holds {tuple(data.shape)} on this rank"
                )
            with torch.no_grad():
                data.copy_(local)
            loaded += 1
    logger.info("loaded %d tensors from HF directory %s", loaded, path)
    return loaded


def _diff(a: Any, b: Any) -> str:
    if is_composed(a) or is_composed(b):
        return component_diff(a, b)
    a, b = foundation_of(a), foundation_of(b)
    return _foundation_diff(a, b)


def _foundation_diff(a: FoundationConfig, b: FoundationConfig) -> str:
    from loong_ckpt.hf_config import arch_diff

    return (
        "; ".join(d.replace(" != ", " (HF) != ", 1) for d in arch_diff(a, b)) or "head_dim / KV groups differ"
    )


def export_hf(checkpoint: str | Path, out: str | Path, *, tokenizer: str | Path | None = None) -> Path:
    """Collective: rank 0 writes an HF directory from a just-saved checkpoint; all ranks wait."""
    from loong_ckpt.convert import mcore_to_hf
    from loong_ckpt.training import read_checkpoint_info

    out = Path(out)
    if not dist.is_initialized() or dist.get_rank() == 0:
        if "embodied" in read_checkpoint_info(checkpoint).meta:  # a policy: LeRobot's layout
            from loong_ckpt.pi05 import mcore_to_lerobot

            mcore_to_lerobot(checkpoint, out)
        else:
            mcore_to_hf(checkpoint, out, tokenizer=tokenizer, force=True, progress=False)
        logger.info("exported HF weights to %s", out)
    if dist.is_initialized():
        dist.barrier()
    return out
