"""The train app on the out-of-tree backend (tests/plugins/loong-fakekunlun): TP=2 under torchrun
gives the CPU backend's losses, through the backend's own collectives, RNG and patches."""

from __future__ import annotations

import json
from collections import Counter

import pytest

STEPS = ["train.steps=4", "train.eval_interval=0", "train.eval_iters=0", "train.save_final=false"]


@pytest.mark.dist
def test_tensor_parallel_training_on_fakekunlun_gives_the_cpu_losses(run_train, tmp_path, monkeypatch):
    cpu = run_train([*STEPS, "parallel.tp=2"], nproc=2, name="cpu", device="cpu").check()
    monkeypatch.setenv("LOONG_FAKEKUNLUN_REPORT", str(tmp_path / "report"))
    plugin = run_train([*STEPS, "parallel.tp=2"], nproc=2, name="plugin", device="fakekunlun").check()
    assert "fakekunlun (cpu, 1 device(s), fakebkcl)" in plugin.stderr
    assert len(cpu.losses()) == 4
    assert plugin.losses() == cpu.losses()
    calls = Counter()
    for report in (tmp_path / "report").glob("rank*.json"):
        calls.update(json.loads(report.read_text()))
    assert {r.name.split("-")[0] for r in (tmp_path / "report").glob("rank*.json")} == {"rank0", "rank1"}
    # the backend's RNG tracker (its patch-manifest entry) is what megatron seeded; host-side weight
    # init draws no TP-forked numbers here (the in-process test covers fork())
    for seam in ("prepare_distributed", "set_device", "manual_seed", "get_rng_state", "set_rng_state",
                 "rng_tracker.add", "current_stream", "synchronize", "memory_stats"):  # fmt: skip
        assert calls[seam] >= 2, (seam, calls)  # both ranks


def test_the_train_app_refuses_te_on_fakekunlun_naming_backend_and_key(run_train):
    run = run_train(["model.layer_backend=te"], name="te", device="fakekunlun")
    assert run.returncode != 0
    assert "config error: model.layer_backend=te: the 'fakekunlun' accelerator does not support 'te'" in run.stderr
