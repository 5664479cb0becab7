import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("megatron_gpt_cpu.py")


def _losses(cmd: list[str]) -> list[float]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517", RANK="0", WORLD_SIZE="1", OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return [float(line.split()[1]) for line in out.stdout.splitlines() if line.startswith("loss")]


def test_megatron_gpt_trains_on_cpu():
    losses = _losses([sys.executable, str(SCRIPT)])
    assert len(losses) == 20
    assert losses[-1] < losses[0] - 1.0, losses


@pytest.mark.dist
def test_megatron_gpt_tensor_parallel_on_cpu_matches_single_process():
    single = _losses([sys.executable, str(SCRIPT)])
    tp2 = _losses([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(SCRIPT), "2"])
    assert len(tp2) == len(single)
    assert max(abs(a - b) for a, b in zip(single, tp2)) < 1e-4
