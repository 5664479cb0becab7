"""parallel.encoder_layout=hetero_dp on 4 gloo processes (TP 2 x DP 2, the tiny VLM's encoder at
TP=1): the images of each micro-batch are split over the TP ranks, each encoded exactly once, and
the losses and every parameter's gradient equal the shared layout's over 10 steps, with sequence
parallelism off and on; a frozen encoder runs no encoder backward."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loong_xpu.testing import launch_env

TESTS = Path(__file__).parent


@pytest.mark.dist
def test_hetero_dp_matches_shared_and_encodes_each_image_once(tmp_path) -> None:
    out = tmp_path / "layouts.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4", "--standalone",
           str(TESTS / "encoder_layout_runs.py"), str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=launch_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    ranks = json.loads(out.read_text())
    media = sum(r["media"] for r in ranks[::2])  # one rank per TP group: the DP replicas' micro-batches
    assert media >= 2 * (0 + 1 + 5 + 2)
    for sp in ("sp=False", "sp=True"):
        for rank, report in enumerate(ranks):
            r = report[sp]
            assert r["num_params"] > 0
            assert r["max_loss_diff"] <= 1e-5, f"{sp} rank {rank}: losses {r['max_loss_diff']}"
            assert r["max_grad_diff"] <= 1e-5, f"{sp} rank {rank}: gradients {r['max_grad_diff']}"
        for step in range(10):  # summed over all ranks: shared encodes everything on both TP ranks
            assert sum(r[sp]["encoded"]["hetero_dp"][step] for r in ranks) == media
            assert sum(r[sp]["encoded"]["shared"][step] for r in ranks) == 2 * media
    assert all(r["backwards"]["trained"] > 0 and r["backwards"]["frozen"] == 0 for r in ranks)
