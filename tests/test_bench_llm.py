"""The CPU side of bench/llm_throughput.py: the Loong commands it launches (one process, or
torchrun with TP + SP over several), the tokens a step holds and the arguments it refuses."""

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).parents[1] / "bench" / "llm_throughput.py"
_spec = importlib.util.spec_from_file_location("llm_throughput", _PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules["llm_throughput"] = bench
_spec.loader.exec_module(bench)


def test_one_gpu_runs_the_train_app_in_one_process(tmp_path):
    args = bench.parse_args(["--mbs", "4", "--variants", "a="])
    cmd = bench.loong_command(args, tmp_path, ["++model.foundation.output_loss=fused"])
    assert cmd[:3] == [sys.executable, "-m", "loong_train"]
    assert "train.global_batch_size=4" in cmd and not any(c.startswith("parallel.tp") for c in cmd)
    assert cmd[-1] == "++model.foundation.output_loss=fused"  # a variant's overrides come last


def test_several_gpus_run_under_torchrun_with_tp_and_sequence_parallelism(tmp_path):
    args = bench.parse_args(["--nproc", "4", "--tp", "2", "--mbs", "3", "--hf-modes"])
    cmd = bench.loong_command(args, tmp_path, [])
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    assert {"parallel.tp=2", "parallel.sequence_parallel=true"} <= set(cmd)
    assert "train.global_batch_size=6" in cmd  # micro-batch 3 on each of DP = 4 / 2 replicas
    assert bench.dp_size(args) == 2


@pytest.mark.parametrize("argv", [
    ["--nproc", "4", "--tp", "3", "--hf-modes"],  # TP must divide the processes
    ["--nproc", "2"],  # HF transformers (default --hf-modes amp) runs on one GPU only
    ["--tp", "0"],
])  # fmt: skip
def test_layouts_that_cannot_run_are_refused(argv):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
