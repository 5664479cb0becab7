"""Run under torchrun (gloo, 2 processes): the train app's loop in several layouts in one launch,
from the same seed on the same data, and record every step's loss, every parameter's whole
gradient (by its one-stage name) and the final evaluation loss; rank 0 writes them to argv[1]
with torch.save. One launch instead of one per run saves the process start-up (megatron import).

    torchrun --standalone --nproc-per-node 2 tests/chunkpipe_runs.py OUT.pt NAME=OVERRIDES;... [NAME=...]

Each run is ``NAME=OVERRIDE;OVERRIDE;...`` (e.g. ``packed-pp2=data.packing=thd;parallel.pp=2``),
the train app's config overrides.
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from megatron.core import parallel_state as mpu

import loong_train
from loong_parallel import init_distributed, shutdown, unwrap
from loong_train.main import to_config
from loong_train.trainer import Trainer
from loong_xpu import get_accelerator


def global_name(name: str, offset: int) -> str:
    """A parameter's name in the one-stage model (pipeline stages number their layers from 0)."""
    if not name.startswith("decoder.layers."):
        return name
    i, rest = name[len("decoder.layers.") :].split(".", 1)
    return f"decoder.layers.{int(i) + offset}.{rest}"


def whole_gradients(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every parameter's reduced gradient of the step just taken, gathered over the pipeline
    stages under its one-stage name (the same on every rank)."""
    model = unwrap(trainer.chunks[0])
    offset = mpu.get_pipeline_model_parallel_rank() * (
        trainer.cfg.model.foundation.num_layers // trainer.cfg.parallel.pp
    )
    mine = {global_name(n, offset): p.main_grad.detach().clone() for n, p in model.named_parameters()}
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        for k, v in part.items():
            merged.setdefault(k, v)
    return merged


class RecordingTrainer(Trainer):
    """The app's trainer, noting each step's loss and gradients and the evaluation loss."""

    def step(self, step: int):
        result = super().step(step)
        self.record.setdefault("losses", []).append(result.loss)
        self.record.setdefault("grads", []).append(whole_gradients(self))
        return result

    def evaluate(self, step: int) -> float:
        self.record["eval_loss"] = super().evaluate(step)
        return self.record["eval_loss"]


def run(name: str, overrides: list[str], out_dir: Path) -> dict:
    config_dir = str(Path(loong_train.__file__).parent / "configs")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = to_config(
            compose("config", overrides=[*overrides, f"train.output_dir={out_dir / name}"])
        )
    trainer = RecordingTrainer(cfg)
    trainer.record = {}
    trainer.fit()
    return trainer.record


def main() -> None:
    out, runs = Path(sys.argv[1]), sys.argv[2:]
    # The launch's process group outlives the runs (a trainer closes only the groups it created).
    init_distributed(get_accelerator())
    records = {}
    for spec in runs:
        name, _, overrides = spec.partition("=")
        records[name] = run(name, [o for o in overrides.split(";") if o], out.parent)
    shutdown()
    if int(os.environ["RANK"]) == 0:
        torch.save(records, out)


if __name__ == "__main__":
    main()
