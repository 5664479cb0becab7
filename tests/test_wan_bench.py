"""bench/wan_throughput.py at wan-tiny shape on the CPU: Loong's Wan and diffusers'
WanTransformer3DModel train the same samples in the same loop (the digests agree step by step),
the token and FLOP accounting is the documented one, and runs on different data are refused."""

import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("diffusers")
sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
from wan_throughput import (  # noqa: E402
    PEAK_BF16,
    STACKS,
    check_same_data,
    latent_shape,
    model_config,
    parse_args,
    run_here,
    summarize,
    tokens_per_sample,
)

TINY = ["--model=wan-tiny", "--device=cpu", "--dtype=fp32", "--frames=5", "--height=32", "--width=48",
        "--text-len=8", "--steps=3", "--warmup=1", "--batch=2", "--recompute=full",
        "--loong-recompute=keep_attention", "--loong-recompute-layers=1"]  # fmt: skip


def test_the_default_clip_is_wans_81_frames_at_480x832():
    args = parse_args([])
    cfg = model_config(args).diffusion
    assert latent_shape(args, cfg) == (16, 21, 60, 104)
    assert tokens_per_sample(args, cfg) == 32_760
    assert cfg.recompute == "full" and cfg.num_layers == 30 and cfg.dim == 1536


def test_loong_and_diffusers_train_the_same_samples_at_wan_tiny_shape():
    args = parse_args(TINY)
    cfg = model_config(args)
    loong = model_config(args, "loong").diffusion  # Loong recomputes less; diffusers checkpoints whole blocks
    assert (loong.recompute, loong.recompute_num_layers, cfg.diffusion.recompute) == ("keep_attention", 1, "full")
    runs = {s: run_here(args, s) for s in STACKS}
    check_same_data(runs)
    assert runs["loong"]["params"] == runs["diffusers"]["params"] == cfg.diffusion.num_parameters()
    assert runs["loong"]["impl"] == "local"
    rows = summarize(args, cfg, runs)
    tokens = tokens_per_sample(args, cfg.diffusion)
    assert tokens == 2 * 2 * 3  # latents 2 x 4 x 6, patches 1 x 2 x 2
    for row, run in zip(rows, runs.values()):
        assert len(run["times"]) == 3 and all(math.isfinite(x) for x in run["losses"])
        assert row.tokens_per_s == pytest.approx(2 * tokens / row.median_s)
        assert row.mfu == pytest.approx(row.tokens_per_s * cfg.diffusion.flops_per_token(tokens) / PEAK_BF16)


def test_the_bench_refuses_runs_that_saw_different_data():
    run = {"digests": ["a", "b", "c"]}
    check_same_data({"loong": run, "diffusers": dict(run)})
    with pytest.raises(SystemExit, match="step 2: loong and diffusers trained on different samples"):
        check_same_data({"loong": run, "diffusers": {"digests": ["a", "x", "c"]}})
    with pytest.raises(SystemExit, match="loong ran 3 steps, diffusers ran 2"):
        check_same_data({"loong": run, "diffusers": {"digests": ["a", "b"]}})
