"""How a training run starts from what is on disk, in one place: ``train.init_from`` (model
weights from an HF directory or a Loong checkpoint), ``resume`` (the newest complete checkpoint of
the run that passes its integrity check and belongs to this run, with optimizer, scheduler and RNG state) and the LoRA rule (checkpoints hold only the
adapters; the frozen base always comes from ``init_from``, the base the adapters were trained on).
Also what a run's checkpoints record so that they can be converted and resumed later."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from loong_ckpt.components import checkpoint_meta
from loong_ckpt.diffusion import is_wan_dir, load_diffusers_weights
from loong_ckpt.hf_io import is_hf_dir
from loong_ckpt.integrity import IntegrityError
from loong_ckpt.log import logger
from loong_ckpt.online import load_hf_weights
from loong_ckpt.run_dir import (
    RUN_CONFIG_KEY,
    ResumeSchedule,
    RunDirError,
    check_resume,
    claim_output_dir,
    flatten_config,
    follow_config_schedule,
)
from loong_ckpt.safe_load import UnsafeCheckpointError
from loong_ckpt.training import (
    CheckpointInfo,
    CheckpointMismatchError,
    _is_main,
    load_checkpoint,
    newest_verified_checkpoint,
    read_checkpoint_info,
)

# A checkpoint whose files changed since they were written, that asks to run code, or that does not
# fit the model as configured.
UNUSABLE_CHECKPOINT = (IntegrityError, UnsafeCheckpointError, CheckpointMismatchError)


class RestoreError(ValueError):
    """The run cannot start from these files as configured; the message names the key."""


@dataclass(frozen=True)
class Restored:
    step: int  # the last completed step (0: a fresh start)
    rng: Any = None  # the RNG state saved with the checkpoint resumed from (None: keep the seed's)
    checkpoint: Path | None = None  # the checkpoint resumed from


def restore(ckpt_root: str | Path, chunks: list, optimizer, scheduler, *, model_cfg: Any, init_from: str | None,
            resume: bool, rng_state_template: Any = None, config: Any = None, overwrite: bool = False,
            resume_schedule: str = ResumeSchedule.refuse) -> Restored:  # fmt: skip
    """Load what the run starts from into ``chunks`` (and optimizer / scheduler on resume); collective.
    ``ckpt_root`` is ``<output dir>/checkpoints``: a fresh run first claims the output dir (refused
    if it holds another run, unless ``overwrite``). On resume: the newest checkpoint that verifies,
    checked against the run's ``config`` (:func:`loong_ckpt.run_dir.check_resume`)."""
    lora = getattr(model_cfg, "lora", None) is not None
    try:
        claim_output_dir(Path(ckpt_root).parent, resume=resume, overwrite=overwrite)
    except RunDirError as e:
        raise RestoreError(str(e)) from None
    run_config = flatten_config(config) if config is not None else None
    resumed = _resume_point(Path(ckpt_root), run_config, resume_schedule) if resume else None
    if resumed is not None and resume_schedule == ResumeSchedule.rescale:
        follow_config_schedule(scheduler)
    if lora and resumed is not None:
        check_lora_base(resumed, init_from)
    if init_from and (resumed is None or lora):
        load_weights(init_from, chunks, model_cfg, part="frozen" if lora else "all")
    if resumed is None and lora and model_cfg.lora.init_from:
        load_adapters(model_cfg.lora.init_from, chunks, model_cfg)
    if resumed is None:
        if init_from:
            # bf16 / fp16 optimizers keep fp32 main copies made when they were built: refresh them from
            # the weights just loaded, or the first step would write the random init back (no-op in fp32).
            optimizer.reload_model_params()
        return Restored(step=0)
    info, rng = load_checkpoint(resumed.path, chunks, optimizer, scheduler, rng_state_template=rng_state_template,
                                verify=False)  # just verified  # fmt: skip
    if _is_main():
        logger.info("resumed from %s (step %d)", info.path, info.step)
    return Restored(step=info.step, rng=rng, checkpoint=info.path)


def _resume_point(ckpt_root: Path, run_config: dict[str, Any] | None, schedule: str) -> CheckpointInfo | None:
    """The newest checkpoint of the run that verifies, if it belongs to this run; collective."""
    resumed = newest_verified_checkpoint(ckpt_root)
    if resumed is None:
        if _is_main():
            logger.warning(
                "resume=true but %s holds no complete checkpoint: starting from scratch", ckpt_root
            )
        return None
    if run_config is not None:
        try:
            other = check_resume(resumed.path, resumed.meta.get(RUN_CONFIG_KEY), run_config, schedule)
        except RunDirError as e:
            raise RestoreError(str(e)) from None
        if other and _is_main():
            logger.info("resuming with changed settings: %s",
                        "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in other.items()))  # fmt: skip
    return resumed


def load_adapters(path: str, chunks: list, model_cfg: Any) -> None:
    """``model.lora.init_from``: the adapters start from a PEFT adapter directory (peft_import.py)."""
    from loong_ckpt.hf_config import ConversionError
    from loong_ckpt.peft_import import load_peft_adapters

    try:
        load_peft_adapters(path, chunks, model_cfg)
    except ConversionError as e:
        raise RestoreError(str(e)) from None


def load_weights(init_from: str, chunks: list, model_cfg: Any, *, part: str = "all") -> None:
    """Model weights (not optimizer state) from an HF directory, a diffusers ``WanTransformer3DModel``
    directory (``model.diffusion``), a LeRobot / OpenPI policy (``model.embodied``: a folder or file
    of safetensors) or a Loong checkpoint."""
    src = Path(init_from)
    if _load_diffusers(init_from, chunks, model_cfg):
        return
    if getattr(model_cfg, "embodied", None) is not None and (src.suffix == ".safetensors" or any(src.glob("*.safetensors"))):
        from loong_ckpt.pi05 import load_lerobot_weights

        load_lerobot_weights(init_from, chunks, model_cfg.embodied)
        return
    if is_hf_dir(init_from):
        load_hf_weights(init_from, chunks, model_cfg)  # every component of a VLM; never LoRA adapters
        return
    info, _ = load_checkpoint(read_checkpoint_info(init_from).path, chunks, part=part)
    if _is_main():
        logger.info("initialised model weights from %s", info.path)


def _load_diffusers(init_from: str, chunks: list, model_cfg: Any) -> bool:
    """A Wan transformer directory (diffusers or Wan-AI layout) into a Wan model, online (each TP rank reads its slices); False
    when neither is one. A diffusers directory for another model, or an HF one for Wan, is refused."""
    wan = getattr(model_cfg, "diffusion", None)
    if is_wan_dir(init_from) != (wan is not None):
        if wan is None:
            raise RestoreError(f"train.init_from={init_from} is a Wan transformer directory (diffusers or Wan-AI "
                               "layout), but the model has no model.diffusion (use a Wan model, e.g. model=wan-tiny)")  # fmt: skip
        if is_hf_dir(init_from):
            raise RestoreError(f"train.init_from={init_from}: an HF model directory, but model.diffusion (Wan) "
                               "starts from a Wan transformer directory (config.json _class_name "
                               "WanTransformer3DModel or WanModel) or a Loong checkpoint")  # fmt: skip
        return False
    if wan is None:
        return False
    load_diffusers_weights(init_from, chunks, wan)
    return True


def check_lora_base(resumed: CheckpointInfo, init_from: str | None) -> None:
    """A LoRA checkpoint's adapters belong to the base weights it was trained on."""
    base = (resumed.meta.get("lora") or {}).get("base")
    if base is None:
        raise RestoreError(f"{resumed.path} is not a LoRA checkpoint but model.lora is set; resume it without LoRA "
                           "or start a LoRA run in another train.output_dir")  # fmt: skip
    if init_from is None or Path(init_from).absolute() != Path(base):
        raise RestoreError(f"train.init_from={init_from!r} but the LoRA checkpoint {resumed.path} was trained on "
                           f"{base}; resume with train.init_from={base}")  # fmt: skip


def run_meta(
    model_cfg: Any, *, init_from: str | None, tokens_per_step: int, config: Any = None
) -> dict[str, Any]:
    """What every checkpoint of the run records beside the weights: the model config (loong-convert
    mcore-to-hf needs nothing else), the HF config it started from, a LoRA run's base, and the run's
    whole ``config`` (flattened; compared on resume)."""
    meta = {"tokens_per_step": tokens_per_step, **checkpoint_meta(model_cfg)}
    if config is not None:
        meta[RUN_CONFIG_KEY] = flatten_config(config)
    if init_from and (is_hf_dir(init_from) or is_wan_dir(init_from)):
        meta["hf_config"] = json.loads((Path(init_from) / "config.json").read_text())
    lora = getattr(model_cfg, "lora", None)
    if lora is not None:  # adapters only; loong-convert merges them into `base` on export
        meta["lora"] = {**asdict(lora), "base": str(Path(init_from).absolute())}
    return meta
