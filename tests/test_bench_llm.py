"""The CPU side of bench/llm_throughput.py: the Loong commands it launches (one process, or
torchrun with TP + SP over several), the tokens a step holds and the arguments it refuses; the
whole bench at the tiny shape on the CPU, where both stacks must report the same batches."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from loong_train.testing import load_script

_PATH = Path(__file__).parents[1] / "bench" / "llm_throughput.py"
bench = load_script(_PATH)


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


def test_the_same_samples_line_states_agreement_or_exits_naming_the_step():
    assert bench.same_samples({"loong a": [1, 2, 3], "hf": [1, 2, 3], "loong dp2": None}) == (
        "same samples: the batch digests of all 3 steps agree across 2 stacks; not reported by loong dp2")
    assert bench.same_samples({"loong a": [1, 2]}).startswith("same samples: not checked (1 stack(s)")
    with pytest.raises(SystemExit, match=r"'loong a' and 'hf' trained different data: step 2 digest 2 != 9"):
        bench.same_samples({"loong a": [1, 2, 3], "hf": [1, 9, 3]})
    with pytest.raises(SystemExit, match=r"'loong a' ran 3 steps, 'hf' 2"):
        bench.same_samples({"loong a": [1, 2, 3], "hf": [1, 2]})


def test_loong_and_hf_train_on_the_same_batches_on_the_cpu():
    """The whole bench at the tiny shape: the train app and the HF worker report each step's
    batch digest from their own data path, and the bench finds them equal."""
    cmd = [sys.executable, str(_PATH), "--model", "tiny", "--seq", "64", "--mbs", "2", "--steps", "3",
           "--warmup", "1", "--hf-modes", "bf16", "--variants", "loong="]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "same samples: the batch digests of all 3 steps agree across 2 stacks" in proc.stdout
    assert "TileLang kernels:" in proc.stdout
    assert re.search(r"loss: step 1 \d+\.\d{4}, last step \d+\.\d{4}, mean of the last 3 \d+\.\d{4}", proc.stdout)
