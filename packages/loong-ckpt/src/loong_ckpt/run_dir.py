"""A run's output directory belongs to one run: a fresh run never writes over another one, and a
resumed run is the same run (same model, same data) continuing, with any change to its LR
schedule chosen explicitly.

The messages name the train app's keys (``resume``, ``train.output_dir``, ``train.overwrite``,
``train.resume_schedule``): they are what a user types to act on them.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from enum import StrEnum
from pathlib import Path
from typing import Any

import torch.distributed as dist

from loong_ckpt.log import logger
from loong_ckpt.training import complete_checkpoints

RUN_CONFIG_KEY = "run_config"  # loong.json: the run's whole config, flattened to dotted keys
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
# Written by a run: what a fresh run would overwrite or mix its own output into.
RUN_OUTPUTS = ("checkpoints", METRICS_FILE, TENSORBOARD_DIR, "hf")
# A resumed run must have the same model and data as the checkpoint (else it is another run).
MUST_MATCH = ("model.", "data.kind", "data.sources", "data.tokenizer")
# Keys that shape the LR schedule: changing them on resume needs train.resume_schedule.
SCHEDULE_KEYS = ("train.steps", "optim.lr", "optim.min_lr", "optim.warmup_steps", "optim.schedule")
# Expected to differ between the interrupted run and its resumption.
_IGNORED = ("resume", "train.output_dir", "train.overwrite", "train.resume_schedule", "train.progress")


class ResumeSchedule(StrEnum):
    """What ``resume=true`` does when the LR schedule's settings (``train.steps``, ``optim.lr``, ...)
    differ from the checkpoint's."""

    refuse = "refuse"  # stop, explaining the two choices below
    rescale = "rescale"  # recompute the schedule from the current config, from the checkpoint's step on
    keep = "keep"  # the checkpoint's schedule (past its last step the LR stays at its minimum)


class RunDirError(ValueError):
    """The output directory or the checkpoint belongs to another run than the one configured."""


def flatten_config(cfg: Any) -> dict[str, Any]:
    """A (nested dataclass) config as ``{"a.b.c": value}``, values as JSON gives them back."""
    tree = json.loads(json.dumps(dataclasses.asdict(cfg), default=str))
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict) and node:
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        else:
            out[prefix[:-1]] = node

    walk(tree, "")
    return out


def previous_run(out_dir: Path) -> str | None:
    """What another run left in ``out_dir`` (None: nothing)."""
    found = []
    ckpts = complete_checkpoints(out_dir / "checkpoints") if (out_dir / "checkpoints").is_dir() else []
    if ckpts:
        found.append(f"{len(ckpts)} checkpoints up to {ckpts[-1].name}")
    elif (out_dir / "checkpoints").is_dir() and any((out_dir / "checkpoints").iterdir()):
        found.append("a checkpoints/ directory")
    metrics = out_dir / METRICS_FILE
    if metrics.is_file() and metrics.stat().st_size:
        found.append(f"{METRICS_FILE} ({sum(1 for _ in metrics.open())} records)")
    found += [f"{name}/" for name in (TENSORBOARD_DIR, "hf") if (out_dir / name).is_dir()]
    return ", ".join(found) or None


def check_fresh_output_dir(out_dir: Path, *, overwrite: bool) -> str | None:
    """A fresh (not resumed) run may only write into a directory without another run's output,
    unless ``overwrite``. Returns what would be replaced (None: nothing), else raises."""
    what = previous_run(out_dir)
    if what and not overwrite:
        raise RunDirError(
            f"train.output_dir={out_dir} holds another run ({what}); continue it with resume=true, "
            "write this run elsewhere with train.output_dir=<new dir>, or replace it with train.overwrite=true"
        )
    return what


def clear_run_outputs(out_dir: Path) -> None:
    """Remove what a previous run wrote into ``out_dir`` (``train.overwrite=true``)."""
    for name in RUN_OUTPUTS:
        path = out_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def claim_output_dir(out_dir: Path, *, resume: bool = False, overwrite: bool = False) -> None:
    """Collective: a fresh run refuses an output directory holding another run
    (:class:`RunDirError`), or with ``overwrite`` has rank 0 clear what that run wrote."""
    if resume:
        return
    replaced = check_fresh_output_dir(out_dir, overwrite=overwrite)
    main = not dist.is_initialized() or dist.get_rank() == 0
    if dist.is_initialized():
        dist.barrier()  # every rank has looked before rank 0 clears it
    if replaced and main:
        logger.warning("train.overwrite=true: replacing the run in %s (%s)", out_dir, replaced)
        clear_run_outputs(out_dir)
    if dist.is_initialized():
        dist.barrier()


def config_changes(stored: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{key: (stored, current)}`` for every key whose value differs (missing on one side: None)."""
    keys = (set(stored) | set(current)) - set(_IGNORED)
    return {k: (stored.get(k), current.get(k)) for k in sorted(keys) if stored.get(k) != current.get(k)}


def _describe(changes: dict[str, tuple[Any, Any]]) -> str:
    return "; ".join(f"{k}: {a!r} in the checkpoint, {b!r} now" for k, (a, b) in changes.items())


def check_resume(
    checkpoint: Path, stored: dict[str, Any] | None, current: dict[str, Any], schedule: str
) -> dict:
    """Compare the config stored with ``checkpoint`` to the current one. Raises :class:`RunDirError`
    for a different model or data, and for a changed LR schedule unless ``schedule`` says what to
    do (``rescale``: follow the current settings; ``keep``: the checkpoint's schedule). Returns the
    remaining changes (logged by the caller; e.g. the parallel layout)."""
    if schedule not in set(ResumeSchedule):
        raise RunDirError(f"train.resume_schedule={schedule!r}; allowed: {', '.join(ResumeSchedule)}")
    if stored is None:  # written before configs were stored: nothing to compare
        return {}
    changes = config_changes(stored, current)
    if blocking := {k: v for k, v in changes.items() if k.startswith(MUST_MATCH)}:
        raise RunDirError(
            f"resume=true: {checkpoint} belongs to another run ({_describe(blocking)}); resume with the "
            "checkpoint's settings, or start a new run in another train.output_dir with "
            f"train.init_from={checkpoint}"
        )
    sched = {k: v for k, v in changes.items() if k in SCHEDULE_KEYS}
    if sched and schedule == "refuse":
        raise RunDirError(
            f"resume=true changes the LR schedule of {checkpoint} ({_describe(sched)}); choose "
            "train.resume_schedule=rescale to follow the current settings from the checkpoint's step on "
            "(the LR is recomputed as if the run had been planned that way), or train.resume_schedule=keep "
            "to continue the checkpoint's schedule (past its last step the LR stays at its minimum)"
        )
    return {k: v for k, v in changes.items() if k not in sched}


def follow_config_schedule(scheduler: Any) -> None:
    """When a checkpoint is loaded into megatron's LR ``scheduler``, keep its own settings (the
    current config: total steps, LRs, warmup) instead of the checkpoint's; the step count still
    comes from the checkpoint. megatron's default keeps the checkpoint's settings."""
    scheduler.use_checkpoint_opt_param_scheduler = False
    scheduler.override_opt_param_scheduler = True
