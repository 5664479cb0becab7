"""The train app end to end on CPU: a tiny model learns, and checkpoints/metrics are where it says."""

from pathlib import Path


def test_tiny_model_trains_and_loss_falls(run_train):
    run = run_train(["train.steps=30", "optim.lr=1e-2", "train.eval_interval=10"]).check()
    losses = run.losses()
    assert sorted(losses) == list(range(1, 31))
    first, last = losses[1], losses[30]
    assert last < first - 1.0, f"loss did not fall enough: {first:.3f} -> {last:.3f}"
    evals = run.records("val")
    assert [e["step"] for e in evals] == [10, 20, 30]
    assert evals[-1]["loss"] < evals[0]["loss"]
    # the report names the checkpoint and metrics it wrote
    assert f"first loss {first:.4f} -> last loss {last:.4f}" in run.stdout
    report = dict(line.split(maxsplit=1) for line in run.stdout.splitlines() if line.startswith(("checkpoint", "metrics")))
    ckpt = Path(report["checkpoint"])
    assert Path(report["metrics"]) == run.out_dir / "metrics.jsonl"
    assert ckpt == run.out_dir / "checkpoints" / "step_00000030"
    assert (ckpt / "loong.json").is_file()
    assert (run.out_dir / "checkpoints" / "latest").read_text().strip() == "step_00000030"
    for rec in run.records("train"):
        assert rec["tokens_per_s"] > 0 and rec["grad_norm"] is not None
    # the logged lr is the rate that step ran at: warm-up 1e-2 * s / 2 (never 0), min_lr at the end
    lrs = {r["step"]: r["lr"] for r in run.records("train")}
    assert abs(lrs[1] - 5e-3) < 1e-9 and abs(lrs[2] - 1e-2) < 1e-9 and abs(lrs[30] - 3e-4) < 1e-9, lrs


def test_zero_steps_saves_initial_weights(run_train):
    run = run_train(["train.steps=0"]).check()
    assert (run.out_dir / "checkpoints" / "step_00000000" / "loong.json").is_file()
