"""Run under torchrun (gloo): the train app's loop twice in one launch, packed data with DP load
balancing off then on, from the same seed; rank 0 writes both runs' metrics paths to argv[1] as
JSON. One launch instead of two halves the process start-up (megatron import) cost of the test.

    torchrun --standalone --nproc-per-node 4 tests/dp_balance_runs.py OUT.json [--config-name=vlm] OVERRIDES...
"""

import json
import os
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

import loong_train
from loong_parallel import init_distributed, shutdown
from loong_train.main import to_config
from loong_train.trainer import Trainer
from loong_xpu import get_accelerator


def main() -> None:
    out_json, overrides = Path(sys.argv[1]), sys.argv[2:]
    config_name = "config"
    if overrides and overrides[0].startswith("--config-name="):
        config_name, overrides = overrides[0].split("=", 1)[1], overrides[1:]
    # The launch's process group outlives both runs (a trainer closes only the groups it created):
    # re-creating it after a teardown hangs in the env:// rendezvous.
    init_distributed(get_accelerator())
    config_dir = str(Path(loong_train.__file__).parent / "configs")
    metrics = {}
    for name in ("off", "on"):
        run_overrides = [*overrides, f"parallel.balance.enabled={'true' if name == 'on' else 'false'}",
                         f"train.output_dir={out_json.parent / name}"]
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            cfg = to_config(compose(config_name=config_name, overrides=run_overrides))
        metrics[name] = str(Trainer(cfg).fit().metrics_file)
    shutdown()
    if int(os.environ["RANK"]) == 0:
        out_json.write_text(json.dumps(metrics))


if __name__ == "__main__":
    main()
