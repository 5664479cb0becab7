"""Optimizer state in host memory (optim.offload_fraction, megatron's HybridDeviceOptimizer) on a
GPU: half and all of the Adam state offloaded, updated on the host (megatron's) or streamed through
the GPU (optim.offload_update=device), give the losses and gradient norms of the all-GPU
precision-aware optimizer from the same weights, and a run resumes from a checkpoint written with
the state on the host onto the same losses. With bf16 moments (optim.state_dtype=bf16, device
update only) the same against the all-GPU optimizer keeping bf16 moments. With the masters kept as
their low halves beside the bf16 weights (optim.offload_master=remainder) the losses of fp32 masters,
and a resume."""

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
        _resumes_onto_the_same_losses(run_train, runs[0.5, update], [*common, f"optim.offload_update={update}"])


def _resumes_onto_the_same_losses(run_train, half, overrides: list[str]) -> None:
    """``half`` (offload_fraction 0.5 with ``overrides``) resumed from its step-3 checkpoint (the
    step-6 one removed) gives its own losses."""
    uninterrupted = half.losses()  # read now: the resumed run rewrites the same metrics file
    shutil.rmtree(half.out_dir / "checkpoints" / f"step_{STEPS:08d}")
    resumed = run_train([*overrides, "optim.offload_fraction=0.5", "resume=true"], name=half.out_dir.name, device="cuda")
    losses = resumed.check().losses()
    assert "(step 3)" in resumed.stderr
    for step in range(4, STEPS + 1):
        assert losses[step] == pytest.approx(uninterrupted[step], abs=1e-3), (overrides, step, losses, uninterrupted)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bf16_moments_on_the_host_keep_the_losses_of_bf16_moments_on_the_gpu_and_resume(tmp_path, data_cache):
    run_train = make_runner(tmp_path, data_cache, defaults=TINY)
    init = run_train(["train.steps=0"], name="init").check()
    common = [*COMMON, f"train.init_from={init.out_dir / 'checkpoints' / 'step_00000000'}", "optim.state_dtype=bf16"]
    plain = run_train(common, name="plain", device="cuda").check()  # TE's FusedAdam keeps bf16 moments
    runs = {}
    for fraction in (0.5, 1.0):
        overrides = [*common, f"optim.offload_fraction={fraction}", "optim.offload_update=device"]
        run = runs[fraction] = run_train(overrides, name=f"offload{fraction}", device="cuda").check()
        assert "moments in bf16" in run.stderr
        for step, loss in plain.losses().items():
            assert run.losses()[step] == pytest.approx(loss, abs=2e-2), (fraction, step)
        for a, b in zip(_grad_norms(plain), _grad_norms(run), strict=True):
            assert b == pytest.approx(a, rel=5e-2), (fraction, _grad_norms(run), _grad_norms(plain))
    # megatron's checkpoint keeps fp32 moments; they load back as the device update's bf16 ones
    _resumes_onto_the_same_losses(run_train, runs[0.5], [*common, "optim.offload_update=device"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_masters_kept_as_low_halves_keep_the_losses_of_fp32_masters_and_resume(tmp_path, data_cache):
    """optim.offload_master=remainder: the same masters bit for bit (the weights rounded alike but at
    exact ties), so the losses of the fp32 masters; train.init_from reloads the masters from the
    weights, and the checkpoints hold the fp32 masters written back (a resume gives the same losses)."""
    run_train = make_runner(tmp_path, data_cache, defaults=TINY)
    init = run_train(["train.steps=0"], name="init").check()
    common = [*COMMON, f"train.init_from={init.out_dir / 'checkpoints' / 'step_00000000'}",
              "optim.offload_update=device"]  # fmt: skip
    for fraction in (1.0, 0.5):
        share = [*common, f"optim.offload_fraction={fraction}"]
        whole = run_train(share, name=f"fp32{fraction}", device="cuda").check()
        halves = run_train([*share, "optim.offload_master=remainder"], name=f"halves{fraction}", device="cuda").check()
        assert "masters as low halves beside the bf16 weights" in halves.stderr
        for step, loss in whole.losses().items():
            assert halves.losses()[step] == pytest.approx(loss, abs=1e-3), (fraction, step)
    _resumes_onto_the_same_losses(run_train, halves, [*common, "optim.offload_master=remainder"])
