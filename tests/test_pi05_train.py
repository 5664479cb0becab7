"""The default vision-language-action job (`train --config-name pi05`) end to end on CPU: a tiny
Pi0.5 learns the bundled Metaworld expert with a falling loss, DP=2 (torchrun, gloo, distributed
optimizer) reproduces one process, and its export is a LeRobot checkpoint that `train.init_from`
reads back (conversion online and offline)."""

from __future__ import annotations

import pytest
import torch

from loong_ckpt.pi05 import from_lerobot, lerobot_to_mcore, read_checkpoint_weights, read_safetensors
from loong_train.testing import make_runner

PI05 = ["--config-name=pi05", "train.tensorboard=false", "train.progress=false", "train.eval_iters=1",
        "train.micro_batch_size=8", "train.global_batch_size=16", "optim.schedule=constant", "optim.warmup_steps=0"]  # fmt: skip


@pytest.fixture
def run_pi05(tmp_path, data_cache):
    return make_runner(tmp_path, data_cache, defaults=PI05)


@pytest.mark.dist
def test_pi05_learns_exports_lerobot_weights_and_dp2_matches_one_process(run_pi05, tmp_path):
    one = run_pi05(["train.steps=16", "train.eval_interval=8", "train.export_hf=true"], name="one").check()
    losses = one.losses()
    first, last = sum(losses[s] for s in (1, 2, 3)) / 3, sum(losses[s] for s in (14, 15, 16)) / 3
    assert last < 0.8 * first, f"loss did not fall: {losses}"
    assert "pi05 (" in one.stderr  # the model kind's description

    # the export is LeRobot's layout holding exactly the checkpoint's weights
    ckpt = one.out_dir / "checkpoints" / "step_00000016"
    weights, cfg = read_checkpoint_weights(ckpt)
    exported = read_safetensors(one.out_dir / "hf" / "step_00000016")
    assert all(k.startswith("model.paligemma_with_expert.") or k.startswith("model.") for k in exported)
    back = from_lerobot(exported, cfg)
    assert back.keys() == weights.keys() and all(torch.equal(back[k], weights[k]) for k in back)

    # online import: a run starting from the LeRobot files saves them unchanged at step 0
    init = run_pi05(
        ["train.steps=0", f"train.init_from={one.out_dir / 'hf' / 'step_00000016'}"], name="init"
    ).check()
    started, _ = read_checkpoint_weights(init.out_dir / "checkpoints" / "step_00000000")
    assert all(torch.equal(started[k], weights[k]) for k in weights)
    # offline import gives the same checkpoint tensors
    offline, _ = read_checkpoint_weights(
        lerobot_to_mcore(one.out_dir / "hf" / "step_00000016", tmp_path / "off", cfg)
    )
    assert all(torch.equal(offline[k], weights[k]) for k in weights)

    # DP=2 with the distributed optimizer: the same global batches and noise draws, the same losses
    short = ["train.steps=3", "train.eval_interval=0", "train.save_final=false"]
    # (the single process queues its steps back to back: no device sync between them, the same losses)
    ref = run_pi05([*short, "train.sync_steps=false"], name="ref").check().losses()
    two = run_pi05([*short, "parallel.distributed_optimizer=true"], nproc=2, name="two").check().losses()
    for step in ref:
        assert two[step] == pytest.approx(ref[step], rel=1e-4), (step, ref, two)
