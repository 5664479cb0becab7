"""Optimizer state in host memory (optim.offload_fraction, megatron's HybridDeviceOptimizer) on a
GPU: half and all of the Adam state offloaded give the losses and gradient norms of the all-GPU
precision-aware optimizer from the same weights, and a run resumes from a checkpoint written with
the state on the host onto the same losses."""

import shutil

import pytest
import torch

from loong_train.testing import TINY, make_runner

STEPS = 6
COMMON = [
    "train.dtype=bf16", "optim.precision_aware=true", "parallel.distributed_optimizer=true",
    f"train.steps={STEPS}", "train.save_interval=3", "train.keep_last=10", "train.eval_interval=0",
    "train.eval_iters=0",
]  # fmt: skip


def _grad_norms(run) -> list[float]:
    return [r["grad_norm"] for r in run.records("train")]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_optimizer_state_on_the_host_keeps_the_losses_and_resumes(tmp_path, data_cache):
    run_train = make_runner(tmp_path, data_cache, defaults=TINY)
    init = run_train(["train.steps=0"], name="init").check()
    common = [*COMMON, f"train.init_from={init.out_dir / 'checkpoints' / 'step_00000000'}"]
    plain = run_train(common, name="plain", device="cuda").check()
    runs = {}
    for fraction in (0.5, 1.0):
        run = run_train([*common, f"optim.offload_fraction={fraction}"], name=f"offload{fraction}", device="cuda")
        runs[fraction] = run.check()
        # the same AdamW in fp32 on the host: bf16 forward and backward round alike
        for step, loss in plain.losses().items():
            assert runs[fraction].losses()[step] == pytest.approx(loss, abs=2e-2), (fraction, step)
        for a, b in zip(_grad_norms(plain), _grad_norms(runs[fraction]), strict=True):
            assert b == pytest.approx(a, rel=5e-2), (fraction, _grad_norms(runs[fraction]), _grad_norms(plain))

    # resume the half-offloaded run from its step-3 checkpoint (the step-6 one removed)
    half = runs[0.5]
    uninterrupted = half.losses()  # read now: the resumed run rewrites the same metrics file
    shutil.rmtree(half.out_dir / "checkpoints" / f"step_{STEPS:08d}")
    resumed = run_train([*common, "optim.offload_fraction=0.5", "resume=true"], name="offload0.5", device="cuda")
    losses = resumed.check().losses()
    assert "(step 3)" in resumed.stderr
    for step in range(4, STEPS + 1):
        assert losses[step] == pytest.approx(uninterrupted[step], abs=1e-3), (step, losses, uninterrupted)
