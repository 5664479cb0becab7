"""Optimizer state in host memory (optim.offload_fraction, megatron's HybridDeviceOptimizer) on a
GPU: half and all of the Adam state offloaded, updated on the host (megatron's) or streamed through
the GPU (optim.offload_update=device), give the losses and gradient norms of the all-GPU
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
    for fraction, update in ((0.5, "host"), (1.0, "host"), (0.5, "device"), (1.0, "device")):
        name = f"offload{fraction}{update}"
        overrides = [*common, f"optim.offload_fraction={fraction}", f"optim.offload_update={update}"]
        run = runs[fraction, update] = run_train(overrides, name=name, device="cuda").check()
        # the same AdamW in fp32 on the host or streamed through the GPU: bf16 forward and backward round alike
        for step, loss in plain.losses().items():
            assert run.losses()[step] == pytest.approx(loss, abs=2e-2), (name, step)
        for a, b in zip(_grad_norms(plain), _grad_norms(run), strict=True):
            assert b == pytest.approx(a, rel=5e-2), (name, _grad_norms(run), _grad_norms(plain))
        if update == "device":
            assert "updated on the device" in run.stderr
            # the host's and the device's build of the same fused AdamW: the same losses but for rounding
            for step, loss in runs[fraction, "host"].losses().items():
                assert run.losses()[step] == pytest.approx(loss, abs=2e-3), (name, step)

    # resume the half-offloaded runs from their step-3 checkpoints (the step-6 ones removed)
    for update in ("host", "device"):
        half = runs[0.5, update]
        uninterrupted = half.losses()  # read now: the resumed run rewrites the same metrics file
        shutil.rmtree(half.out_dir / "checkpoints" / f"step_{STEPS:08d}")
        overrides = [*common, "optim.offload_fraction=0.5", f"optim.offload_update={update}", "resume=true"]
        resumed = run_train(overrides, name=f"offload0.5{update}", device="cuda")
        losses = resumed.check().losses()
        assert "(step 3)" in resumed.stderr
        for step in range(4, STEPS + 1):
            assert losses[step] == pytest.approx(uninterrupted[step], abs=1e-3), (update, step, losses, uninterrupted)
