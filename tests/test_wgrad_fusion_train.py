"""parallel.wgrad_fusion=true through the train app: the tiny VLM (ViT, projector and LLM, local
layers on the CPU, 2 micro-batches per step) trains on the same loss curve as without it, with every
megatron linear accumulating its weight gradient into main_grad (loong_xpu.wgrad in apex's place)."""

from __future__ import annotations

import pytest

from loong_train.testing import make_runner

VLM = ["--config-name=vlm", "train.tensorboard=false", "train.progress=false", "train.eval_iters=0",
       "train.save_final=false", "train.steps=3", "train.log_interval=1"]  # fmt: skip


def test_a_vlm_trains_the_same_with_fused_wgrad_accumulation(tmp_path, data_cache):
    run = make_runner(tmp_path, data_cache, defaults=VLM)
    base = run(["parallel.wgrad_fusion=false"], name="off").check()
    fused = run(["parallel.wgrad_fusion=true"], name="on").check()
    assert "megatron linears accumulate wgrad into main_grad" not in base.stdout + base.stderr
    log = fused.stdout + fused.stderr
    assert "parallel.wgrad_fusion: 0 TE and " in log and " 0 megatron linears" not in log, log[-2000:]
    off, on = base.losses(), fused.losses()
    assert sorted(off) == sorted(on) == [1, 2, 3]
    assert all(on[s] == pytest.approx(off[s], rel=1e-6) for s in off), (off, on)
