"""Run under torchrun (gloo): the VLM job of a layout twice in one launch. ``full``: 4 steps,
checkpoints at steps 2 and 4, HF export at the end. ``resumed``: a fresh output folder holding
only full's step-2 checkpoint, ``resume=true``. Rank 0 writes both runs' metrics paths and the
HF export folder to argv[1] as JSON (one launch: megatron's import cost is paid once).

    torchrun --standalone --nproc-per-node 2 tests/vlm_resume_runs.py OUT.json OVERRIDES...
"""

import json
import os
import shutil
import sys
from pathlib import Path

import torch.distributed as dist
from hydra import compose, initialize_config_dir

import loong_train
from loong_parallel import init_distributed, shutdown
from loong_train.main import to_config
from loong_train.trainer import Trainer
from loong_xpu import get_accelerator


def run(overrides: list[str]):
    with initialize_config_dir(config_dir=str(Path(loong_train.__file__).parent / "configs"), version_base=None):
        return Trainer(to_config(compose(config_name="vlm", overrides=overrides))).fit()


def main() -> None:
    out_json, overrides = Path(sys.argv[1]), sys.argv[2:]
    init_distributed(get_accelerator())  # outlives both runs (a trainer closes only the groups it created)
    full_dir, resumed_dir = out_json.parent / "full", out_json.parent / "resumed"
    common = [*overrides, "train.steps=4", "train.save_interval=2", "train.keep_last=5", "train.eval_iters=0",
              "optim.schedule=constant", "optim.warmup_steps=0"]  # fmt: skip
    full = run([*common, f"train.output_dir={full_dir}", "train.export_hf=true"])
    if int(os.environ["RANK"]) == 0:
        (resumed_dir / "checkpoints").mkdir(parents=True)
        shutil.copytree(full_dir / "checkpoints" / "step_00000002", resumed_dir / "checkpoints" / "step_00000002")
        (resumed_dir / "checkpoints" / "latest").write_text("step_00000002\n")
    dist.barrier()
    resumed = run([*common, f"train.output_dir={resumed_dir}", "resume=true"])
    shutdown()
    if int(os.environ["RANK"]) == 0:
        out_json.write_text(json.dumps({"full": str(full.metrics_file), "resumed": str(resumed.metrics_file),
                                        "hf": str(full.hf_export)}))  # fmt: skip


if __name__ == "__main__":
    main()
