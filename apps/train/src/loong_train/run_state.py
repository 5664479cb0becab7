"""Which state a run starts from: a fresh output directory (never another run's), or the newest
checkpoint of its own run that verifies, with the same model and data."""

from __future__ import annotations

from pathlib import Path

import torch

from loong_ckpt.run_dir import (
    RUN_CONFIG_KEY,
    RunDirError,
    check_fresh_output_dir,
    check_resume,
    clear_run_outputs,
    flatten_config,
)
from loong_ckpt.training import CheckpointInfo, newest_verified_checkpoint
from loong_parallel import follow_config_schedule
from loong_train.log import logger
from loong_train.schema import Config, ConfigError


def claim_output_dir(cfg: Config, out_dir: Path, is_main: bool) -> None:
    """Collective: a fresh run refuses a directory holding another run, or with
    ``train.overwrite=true`` clears what that run wrote."""
    if cfg.resume:
        return
    try:
        replaced = check_fresh_output_dir(out_dir, overwrite=cfg.train.overwrite)
    except RunDirError as e:
        raise ConfigError(str(e)) from None
    torch.distributed.barrier()  # every rank has looked before rank 0 clears it
    if replaced and is_main:
        logger.warning("train.overwrite=true: replacing the run in %s (%s)", out_dir, replaced)
        clear_run_outputs(out_dir)
    torch.distributed.barrier()


def resume_point(cfg: Config, ckpt_root: Path, is_main: bool) -> CheckpointInfo | None:
    """Collective: the checkpoint ``resume=true`` continues from (None: start fresh): the newest
    that verifies, and of this run (same model and data, an LR schedule change chosen)."""
    if not cfg.resume:
        return None
    info = newest_verified_checkpoint(ckpt_root)
    if info is None:
        if is_main:
            logger.warning(
                "resume=true but %s holds no complete checkpoint: starting from scratch", ckpt_root
            )
        return None
    try:
        other = check_resume(
            info.path, info.meta.get(RUN_CONFIG_KEY), run_config(cfg), cfg.train.resume_schedule
        )
    except RunDirError as e:
        raise ConfigError(str(e)) from None
    if other and is_main:
        changed = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in other.items())
        logger.info("resuming with changed settings: %s", changed)
    return info


def apply_schedule_choice(cfg: Config, scheduler) -> None:
    """``train.resume_schedule=rescale``: the resumed LR schedule follows the current config."""
    if cfg.train.resume_schedule == "rescale":
        follow_config_schedule(scheduler)


def run_config(cfg: Config) -> dict:
    """What a checkpoint records of the run's config (compared on resume)."""
    return flatten_config(cfg)
