"""DP load balancing on 4 gloo processes: samples are exchanged intact and exactly once, and
the global-batch loss with balancing equals the loss without it (per-token loss normalisation
makes the assignment irrelevant up to floating-point summation order), also with context
parallelism (CP=2 x DP=2: the balancer plans over the DP group only)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loong_train.testing import TINY
from loong_xpu.testing import launch_env

TESTS = Path(__file__).parent
STEPS = 4
# Loss sums over the same tokens in a different order: fp32 agrees to ~1e-7 relative.
REL_TOL = 1e-6


def torchrun(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4", "--standalone",
           str(TESTS / script), *args]
    return subprocess.run(cmd, cwd=cwd, env=launch_env(), capture_output=True, text=True, timeout=600)


@pytest.mark.dist
def test_exchange_moves_every_sample_exactly_once(tmp_path) -> None:
    proc = torchrun("balance_exchange_check.py", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "OK imbalance" in proc.stdout


@pytest.mark.dist
@pytest.mark.parametrize("cp", [1, 2], ids=["dp4", "cp2-dp2"])
def test_balanced_loss_equals_unbalanced_loss(tmp_path, data_cache, cp) -> None:
    """Packed text at DP=4, and at CP=2 x DP=2: the balancer exchanges samples over the DP group
    (one exchange per CP rank, the same samples), each padded to 2 x cp before packing."""
    overrides = [
        *TINY, f"data.cache_dir={data_cache}", f"parallel.cp={cp}", "data.packing=thd", "data.seq_length=128",
        "data.thd.median_length=16", "data.thd.long_fraction=0.1", "train.global_batch_size=32",
        f"train.steps={STEPS}", "train.eval_iters=0", "parallel.balance.min_imbalance=0.0",
        "parallel.balance.refit_warmup_steps=1", "parallel.balance.refit_interval=1",
    ]  # fmt: skip
    out = tmp_path / "runs.json"
    proc = torchrun("dp_balance_runs.py", str(out), *overrides, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    paths = json.loads(out.read_text())
    off, on = ([json.loads(line) for line in Path(paths[k]).read_text().splitlines()] for k in ("off", "on"))
    assert [r["step"] for r in off] == [r["step"] for r in on] == list(range(1, STEPS + 1))
    for a, b in zip(off, on):
        assert b["loss"] == pytest.approx(a["loss"], rel=REL_TOL), f"step {a['step']}"
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    # Balancing really happened and helped.
    assert all(r["dp_balance_skipped"] == "" for r in on)
    assert all(r["dp_imbalance"] < r["dp_imbalance_naive"] for r in on)
    assert sum(r["dp_imbalance_naive"] for r in on) / STEPS > 0.1


@pytest.mark.dist
@pytest.mark.parametrize("cp", [1, 2], ids=["dp4", "cp2-dp2"])
def test_balanced_multimodal_loss_equals_unbalanced_loss(tmp_path, data_cache, cp) -> None:
    """The tiny VLM on the bundled images and captions at DP=4, and at CP=2 x DP=2: the balancer
    plans each step from the samples' LLM tokens and ViT patches (refitted from the measured times
    as they come) over the DP group, every CP rank of a DP rank takes the same samples and its
    zigzag share of them, and the losses match. That a refit changes the plan is
    packages/loong-parallel/tests/test_balance_multimodal.py."""
    overrides = [
        "--config-name=vlm", f"data.cache_dir={data_cache}", f"parallel.cp={cp}", "train.global_batch_size=16",
        "train.micro_batch_size=1", f"train.steps={STEPS}", "train.eval_iters=0", "train.save_final=false",
        "train.tensorboard=false", "train.progress=false", "parallel.balance.min_imbalance=0.0",
        "parallel.balance.refit_warmup_steps=1", "parallel.balance.refit_interval=1",
    ]  # fmt: skip
    out = tmp_path / "runs.json"
    proc = torchrun("dp_balance_runs.py", str(out), *overrides, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    paths = json.loads(out.read_text())
    off, on = ([json.loads(line) for line in Path(paths[k]).read_text().splitlines()] for k in ("off", "on"))
    off, on = ([r for r in rows if r.get("split", "train") == "train"] for rows in (off, on))
    assert [r["step"] for r in off] == [r["step"] for r in on] == list(range(1, STEPS + 1))
    for a, b in zip(off, on):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), f"step {a['step']}"
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    assert all(r["dp_imbalance"] <= r["dp_imbalance_naive"] for r in on)
    assert any(r["dp_imbalance"] < r["dp_imbalance_naive"] for r in on), "no step was rebalanced"
