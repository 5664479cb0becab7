"""parallel.encoder_layout on 4 gloo processes, the tiny VLM's encoder at TP=1: hetero_dp at TP 2 x
DP 2 (the images of each micro-batch split over the TP ranks) and decoupled at TP 2 x PP 2 (the
images of a step split over all four ranks, encoded outside the pipeline schedule). Each image is
encoded exactly once per step, and the losses and every parameter's gradient equal the shared
layout's over the steps, with sequence parallelism off and on; a frozen encoder runs no encoder
backward. One torchrun launch for both layouts (megatron's import cost is paid once)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loong_xpu.testing import launch_env

TESTS = Path(__file__).parent


def check_layout(ranks: list[dict], layout: str, media: int, shared_encodes: int) -> None:
    """``shared_encodes``: how many ranks encode each image in the shared layout."""
    for sp in ("sp=False", "sp=True"):
        for rank, report in enumerate(ranks):
            r = report[layout][sp]
            assert r["num_params"] > 0
            assert r["max_loss_diff"] <= 1e-5, f"{layout} {sp} rank {rank}: losses {r['max_loss_diff']}"
            assert r["max_grad_diff"] <= 1e-5, f"{layout} {sp} rank {rank}: gradients {r['max_grad_diff']}"
            # the grad norm (clipping's input) counts an encoder copied on several stages once: relative,
            # as the norm sums the squares of all gradients (elementwise 1e-5 adds up)
            norm = r["max_norm_rel_diff"]
            assert norm <= 1e-4, f"{layout} {sp} rank {rank}: grad norms differ by {norm:.2e} (relative)"
        assert len(ranks[0][layout][sp]["encoded"][layout]) == 10  # steps
        for step in range(10):  # summed over all ranks
            assert sum(r[layout][sp]["encoded"][layout][step] for r in ranks) == media
            assert sum(r[layout][sp]["encoded"]["shared"][step] for r in ranks) == shared_encodes * media
    assert all(r[layout]["backwards"]["trained"] > 0 and r[layout]["backwards"]["frozen"] == 0 for r in ranks)


@pytest.mark.dist
def test_encoder_layouts_match_shared_and_encode_each_image_once(tmp_path) -> None:
    out = tmp_path / "layouts.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4", "--standalone",
           str(TESTS / "encoder_layout_runs.py"), str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=launch_env(), capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-6000:]
    ranks = json.loads(out.read_text())
    # hetero_dp: one rank per TP group holds its DP replica's micro-batches; shared encodes on both TP ranks
    media = sum(r["hetero_dp"]["media"] for r in ranks[::2])
    assert media >= 2 * (0 + 1 + 5 + 2)
    check_layout(ranks, "hetero_dp", media, shared_encodes=2)
    # decoupled: one replica; shared encodes on the first stage's two TP ranks, decoupled on all four
    media = ranks[0]["decoupled"]["media"]
    assert media >= 0 + 1 + 5 + 2
    check_layout(ranks, "decoupled", media, shared_encodes=2)
    assert all(r["decoupled"]["backwards"]["trained"] > 0 for r in ranks[2:])  # later stages encode too
