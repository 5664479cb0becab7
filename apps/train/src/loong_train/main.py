"""`train` entry point: compose the Hydra config, run ``Trainer(cfg).fit()``, say where things are."""

from __future__ import annotations

import logging
import os
import sys

import hydra
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from loong_xpu.log import quiet_megatron

CONFIG_PACKAGES = ("loong_train.configs", "loong_models.configs")  # where the config groups live


def _setup_logging() -> None:
    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(
        level=logging.WARNING,
        format=f"[loong{'' if rank == 0 else f' rank{rank}'}] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # megatron's CUDA-graph module logs each capture ("built N cuda graph(s)", parallel.cuda_graphs);
    # loong_kernels logs each measured kernel choice (which implementation a fused op runs)
    for name in ("loong_train", "loong_xpu", "loong_kernels", "loong_models", "loong_parallel", "loong_data", "loong_ckpt",
                 "megatron.core.transformer.cuda_graphs"):  # fmt: skip
        logging.getLogger(name).setLevel(logging.INFO if rank == 0 else logging.WARNING)


def to_config(raw: DictConfig):
    """Merge the composed YAML into the schema: unknown keys and wrong types fail here."""
    from loong_train.schema import Config

    merged = OmegaConf.merge(OmegaConf.structured(Config), raw)
    return OmegaConf.to_object(merged)


@hydra.main(config_path="configs", config_name="config", version_base=None)
def _hydra_main(raw: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from loong_ckpt import ConversionError
    from loong_ckpt.restore import UNUSABLE_CHECKPOINT
    from loong_data.step_data import DataError
    from loong_parallel import NonFiniteError
    from loong_train.recipe import apply_finetune_recipe
    from loong_train.schema import ConfigError
    from loong_train.trainer import Trainer

    hydra_cfg = HydraConfig.get()
    recipe = apply_finetune_recipe(raw, hydra_cfg.runtime.choices.get("phase"), list(hydra_cfg.overrides.task))
    if recipe and int(os.environ.get("RANK", 0)) == 0:
        logging.getLogger("loong_train").info(recipe)
    try:
        cfg = to_config(raw)
    except OmegaConfBaseException as e:
        sys.exit(f"config error: {e}".splitlines()[0] + _detail(e))
    try:
        summary = Trainer(cfg).fit()
    except (ConfigError, DataError) as e:
        sys.exit(f"config error: {e}")
    except (ConversionError, FileNotFoundError, NonFiniteError, *UNUSABLE_CHECKPOINT) as e:  # one-line messages
        sys.exit(f"error: {e}")
    if int(os.environ.get("RANK", 0)) == 0:
        print(_report(summary), flush=True)


def _detail(e: OmegaConfBaseException) -> str:
    key = getattr(e, "full_key", None)
    return f"\n    key: {key}" if key else ""


def _report(s) -> str:
    lines = []
    if s.first_loss is not None:
        lines.append(f"first loss {s.first_loss:.4f} -> last loss {s.last_loss:.4f}")
    if s.eval_loss is not None:
        lines.append(f"eval loss {s.eval_loss:.4f}")
    if s.tokens_per_s:
        lines.append(f"throughput {s.tokens_per_s:,.0f} tokens/s")
    if s.checkpoint:
        lines.append(f"checkpoint   {s.checkpoint}")
    if s.hf_export:
        lines.append(f"hf weights   {s.hf_export}")
    lines.append(f"metrics      {s.metrics_file}")
    if s.tensorboard_dir:
        lines.append(f"tensorboard  {s.tensorboard_dir}  (tensorboard --logdir {s.tensorboard_dir})")
    return "\n".join(lines)


def main() -> None:
    from loong_train.megatron_args import hydra_argv

    quiet_megatron()
    from loong_models.overrides import check_overrides
    from loong_train.schema import Config

    if (message := check_overrides(sys.argv[1:], Config, CONFIG_PACKAGES)) is not None:
        sys.exit(f"config error: {message}")
    _setup_logging()
    sys.argv = [sys.argv[0], *hydra_argv(sys.argv[1:])]  # `train --megatron -- <flags>`: megatron_args.py
    _hydra_main()


if __name__ == "__main__":
    main()
