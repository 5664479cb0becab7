"""`train` entry point: compose the Hydra config, validate it, run the loop, say where things are."""

from __future__ import annotations

import logging
import os
import sys
import warnings

import hydra
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException


def _quiet_third_party() -> None:
    # megatron-core warns at import about optional packages (apex, TE) that the layer-spec choice
    # already accounts for, and GPTModel's deprecation is a known, documented choice (loong-models).
    warnings.filterwarnings("ignore", module=r"megatron\.")
    warnings.filterwarnings("ignore", category=SyntaxWarning, message=r"invalid escape sequence")
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine) (is|are) not installed")
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    logging.getLogger("megatron.core.models.gpt.gpt_model").setLevel(logging.ERROR)
    # Loong saves synchronously; megatron routes that through its (deprecated) async path.
    logging.getLogger("megatron.core.dist_checkpointing.strategies.torch").setLevel(logging.ERROR)


def _setup_logging() -> None:
    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(
        level=logging.WARNING,
        format=f"[loong{'' if rank == 0 else f' rank{rank}'}] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for name in ("loong_train", "loong_xpu", "loong_models", "loong_parallel", "loong_data", "loong_ckpt"):
        logging.getLogger(name).setLevel(logging.INFO if rank == 0 else logging.WARNING)


def to_config(raw: DictConfig):
    """Merge the composed YAML into the schema: unknown keys and wrong types fail here."""
    from loong_train.schema import Config

    merged = OmegaConf.merge(OmegaConf.structured(Config), raw)
    return OmegaConf.to_object(merged)


@hydra.main(config_path="configs", config_name="config", version_base=None)
def _hydra_main(raw: DictConfig) -> None:
    from loong_train.loop import run
    from loong_train.schema import ConfigError

    try:
        cfg = to_config(raw)
    except OmegaConfBaseException as e:
        sys.exit(f"config error: {e}".splitlines()[0] + _detail(e))
    try:
        summary = run(cfg)
    except ConfigError as e:
        sys.exit(f"config error: {e}")
    except (FileNotFoundError, *_run_errors()) as e:
        sys.exit(f"error: {e}")
    if int(os.environ.get("RANK", 0)) == 0:
        print(_report(summary), flush=True)


def _run_errors() -> tuple[type[Exception], ...]:
    """Failures with a complete one-line message: a checkpoint that does not verify or asks to run
    code, a run that keeps producing NaN / Inf."""
    from loong_ckpt.integrity import IntegrityError
    from loong_ckpt.safe_load import UnsafeCheckpointError
    from loong_parallel import NonFiniteError

    return IntegrityError, UnsafeCheckpointError, NonFiniteError


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
    _quiet_third_party()
    _setup_logging()
    _hydra_main()


if __name__ == "__main__":
    main()
