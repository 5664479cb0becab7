"""Encoder tensor parallelism different from the foundation's, and pipeline parallelism, under
torchrun with gloo: encoder TP=1 (replicated) and TP=2 inside foundation TP=2, and PP=2 (encoder
on the first stage), give the one-process loss and encoder / projector gradients."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from loong_xpu.testing import launch_env

HERE = Path(__file__).parent


def launch(nproc: int, runs: list[str], out: Path) -> None:
    env = launch_env()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(HERE / "encoder_tp_worker.py"), "--runs", *runs, "--out", str(out), "--state", str(out / "state.pt")]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]


def close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=lambda m: f"{what}: {m}")


@pytest.mark.dist
def test_encoder_tp_and_pipeline_layouts_match_one_process(tmp_path):
    launch(1, ["1,1,1"], tmp_path)
    launch(2, ["2,1,1", "2,1,2", "1,2,1"], tmp_path)
    one = torch.load(tmp_path / "tp1_pp1_etp1_rank0.pt")
    for etp in (1, 2):  # foundation TP=2: both ranks hold the (replicated or sharded) encoder
        ranks = [torch.load(tmp_path / f"tp2_pp1_etp{etp}_rank{r}.pt") for r in range(2)]
        for out in ranks:
            close(out["loss"], one["loss"], f"encoder TP={etp} loss")
            assert len(out["grads"]) >= (26 if etp == 1 else 10)
            for name, grad in out["grads"].items():
                close(grad, one["grads"][name], f"encoder TP={etp} {name}")
        for name in ranks[0]["grads"]:  # replicas stay bitwise identical over the foundation's TP group
            assert torch.equal(ranks[0]["grads"][name], ranks[1]["grads"][name]), name
    first, last = (torch.load(tmp_path / f"tp1_pp2_etp1_rank{r}.pt") for r in range(2))
    close(last["loss"], one["loss"], "PP=2 loss")
    assert len(first["grads"]) == len(one["grads"])
    for name, grad in first["grads"].items():
        close(grad, one["grads"][name], f"PP=2 {name}")
