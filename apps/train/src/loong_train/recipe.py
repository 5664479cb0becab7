"""The fine-tuning recipe for pretrained weights: ``train.init_from`` with the default phase and
no rate of the user's own gets ``phase=finetune``'s optimizer settings, and the log says so."""

from __future__ import annotations

from importlib import resources

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

FINETUNE = "finetune"


def _finetune_optim() -> DictConfig:
    return OmegaConf.load(resources.files("loong_train.configs") / "phase" / f"{FINETUNE}.yaml").optim


def apply_finetune_recipe(raw: DictConfig, phase: str | None, task_overrides: list[str]) -> str | None:
    """Switch ``raw`` (composed) to the fine-tuning rates when it starts from pretrained weights
    under the default pretraining phase and the command line chose neither a phase nor a rate;
    the user's other ``optim.*`` overrides still win. Returns the line to log, or None."""
    overrides = OverridesParser.create().parse_overrides(task_overrides)
    keys = {o.key_or_group for o in overrides}
    if not raw.train.init_from or phase != "pretrain" or keys & {"phase", "optim", "optim.lr"}:
        return None
    raw.optim = OmegaConf.merge(raw.optim, _finetune_optim())
    for o in overrides:
        if o.key_or_group.startswith("optim.") and not o.is_delete():
            OmegaConf.update(raw, o.key_or_group, o.value(), merge=True)
    o = raw.optim
    return (f"train.init_from={raw.train.init_from} starts from trained weights: fine-tuning recipe "
            f"phase={FINETUNE} (optim.lr={o.lr:g} -> min_lr={o.min_lr:g}, warm-up {o.warmup_steps} steps); "
            "phase=pretrain or optim.lr=... to choose otherwise")  # fmt: skip
