"""The default multimodal job (`train --config-name vlm`) end to end on CPU: a tiny VLM learns on
the bundled real images, writes a checkpoint, resumes on the same loss curve, refuses bad input
naming the key, runs DP=2 (torchrun, gloo) like one process, and its alignment phase leaves the
frozen components untouched."""

from __future__ import annotations

import shutil

import pytest
import torch
from train_helpers import make_runner

from loong_ckpt.mcore_io import read_metadata, read_regions

# The job as configured, shortened; a constant LR makes a 3-step run the prefix of a 6-step run.
VLM = ["--config-name=vlm", "train.tensorboard=false", "train.progress=false", "train.eval_iters=1"]
SHORT = ["train.steps=6", "train.eval_interval=3", "train.save_interval=3", "train.keep_last=5",
         "optim.schedule=constant", "optim.warmup_steps=0"]  # fmt: skip


@pytest.fixture
def run_vlm(tmp_path, data_cache):
    return make_runner(tmp_path, data_cache, defaults=VLM)


@pytest.fixture(scope="module")
def vlm_runner_factory(data_cache):
    return lambda base: make_runner(base, data_cache, defaults=VLM)


def _tensors(ckpt, prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    meta = read_metadata(ckpt)
    regions = {k: (tuple(0 for _ in m.size), torch.empty(m.size, dtype=m.properties.dtype))
               for k, m in meta.items() if k.startswith(prefixes)}  # fmt: skip
    read_regions(ckpt, regions)
    return {k: t for k, (_, t) in regions.items()}


@pytest.mark.slow
def test_vlm_job_learns_checkpoints_and_resumes(run_vlm):
    full = run_vlm([*SHORT, "optim.lr=3e-3"], name="full").check()
    losses = full.losses()
    assert sorted(losses) == list(range(1, 7))
    assert losses[6] < losses[1] - 0.3, f"loss did not fall: {losses}"
    train = full.records("train")
    assert all(r["images_per_s"] > 0 and r["tokens_per_s"] > 0 for r in train)
    assert [r["step"] for r in full.records("val")] == [3, 6]
    ckpts = full.out_dir / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_00000006"
    assert (ckpts / "step_00000003" / "loong.json").is_file()

    # the same run killed after its step-3 checkpoint: resume from there, same losses after it
    half = full.out_dir.parent / "half"
    half.mkdir()
    (half / "checkpoints").mkdir()
    shutil.copytree(ckpts / "step_00000003", half / "checkpoints" / "step_00000003")
    (half / "checkpoints" / "latest").write_text("step_00000003\n")
    resumed = run_vlm([*SHORT, "optim.lr=3e-3", "resume=true"], name="half").check()
    assert "(step 3)" in resumed.stderr
    for step in (4, 5, 6):
        assert abs(resumed.losses()[step] - losses[step]) <= 1e-5, (step, resumed.losses()[step], losses[step])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model=tiny"], "model.image_encoder"),  # images in the data, no image encoder in the model
        (["data.tokenizer=BUNDLED_TEXT_TOKENIZER"], "<|image_pad|>"),
        (["data.packing=fixed"], "data.packing"),
        (["data.multimodal.jsonl=[/nonexistent/x.jsonl]"], "/nonexistent/x.jsonl"),
    ],
    ids=["no-image-encoder", "tokenizer-without-vision-tokens", "fixed-packing", "missing-jsonl"],
)
def test_bad_multimodal_input_names_the_key(run_vlm, overrides, message):
    from loong_data import default_tokenizer

    overrides = [o.replace("BUNDLED_TEXT_TOKENIZER", str(default_tokenizer())) for o in overrides]
    run = run_vlm(["train.steps=1", *overrides])
    assert run.returncode != 0
    assert message in run.stderr, run.stderr[-2000:]
    assert "Traceback" not in run.stderr, run.stderr[-2000:]
