"""The default diffusion job (`train --config-name wan`) end to end on CPU: the tiny Wan DiT learns
(flow matching) on the bundled captioned images and clips encoded by a tiny random Wan VAE and
UMT5 encoder, resumes on the same loss curve, runs TP=2 with sequence parallelism (torchrun, gloo) like one process, and
`sample` writes frames from its checkpoint, and a run starts from a diffusers WanTransformer3DModel
directory (online) exactly as from its offline-converted checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from loong_train.testing import make_runner
from loong_xpu.testing import launch_env

WAN = ["--config-name=wan", "train.tensorboard=false", "train.progress=false", "train.log_interval=1",
       "optim.schedule=constant", "optim.warmup_steps=0"]  # fmt: skip


@pytest.fixture
def run_wan(tmp_path, data_cache):
    return make_runner(tmp_path, data_cache, defaults=WAN)


def test_wan_job_learns_resumes_and_samples(run_wan, data_cache, tmp_path):
    full = run_wan(["train.steps=40", "train.eval_interval=10", "train.save_interval=20", "train.keep_last=5"],
                   name="full", timeout=1200).check()  # fmt: skip
    losses = full.losses()
    assert sorted(losses) == list(range(1, 41))
    first, last = sum(losses[s] for s in range(1, 11)) / 10, sum(losses[s] for s in range(31, 41)) / 10
    assert last < first, f"loss did not fall: {first:.3f} -> {last:.3f}"  # noisy: each step draws its noise levels
    val = {r["step"]: r["loss"] for r in full.records("val")}  # a fixed batch with fixed noise: the clear signal
    assert sorted(val) == [10, 20, 30, 40] and val[40] < 0.9 * val[10], val
    assert all(r["tokens_per_s"] > 0 for r in full.records("train"))
    ckpt = full.out_dir / "checkpoints" / "step_00000040"
    assert json.loads((ckpt / "loong.json").read_text())["model"]["diffusion"]["num_layers"] == 2

    # resume from step 20: the same batches and noise, so the same losses
    part = full.out_dir.parent / "part"
    part.mkdir()
    import shutil

    shutil.copytree(full.out_dir / "checkpoints" / "step_00000020", part / "checkpoints" / "step_00000020")
    (part / "checkpoints" / "latest").write_text("step_00000020\n")
    resumed = run_wan(["train.steps=25", "resume=true", "train.resume_schedule=keep"], name="part", timeout=900).check()
    again = resumed.losses()
    assert sorted(again) == list(range(21, 26))
    assert all(abs(again[s] - losses[s]) < 1e-5 for s in again), (again, losses)

    data = next(data_cache.glob("diffusion-bundled-32px"))
    out = tmp_path / "samples"
    proc = subprocess.run([sys.executable, "-m", "loong_train.sample", str(ckpt), "--data", str(data), "--out", str(out),
                           "--limit", "4", "--steps", "4"], env=launch_env("cpu"), capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "retrieval.json").read_text())
    assert len(report["captions"]) == 4 and len(report["nearest_is_own"]) == 4
    assert (out / "grid.png").is_file() and len(list(out.glob("0*.png")) + list(out.glob("0*.gif"))) == 4


@pytest.mark.dist
def test_wan_tp2_with_sequence_parallelism_and_cp2_match_one_process(run_wan):
    """TP=2 with megatron sequence parallelism (the video tokens split between the linears; the
    replicated modulation / norm / head grads summed over TP) and context parallelism (CP=2: each
    rank holds half of every sample's tokens, the loss is summed over the CP ranks) train like one
    process. TP=2 without SP is checked at the model level by loong-ckpt's Wan TP worker (same
    launch as SP's); CP layouts gradient by gradient by loong-parallel's wan_cp_worker."""
    short = ["train.steps=3", "train.eval_iters=0", "train.save_final=false"]
    one = run_wan(short, name="tp1", timeout=900).check().losses()
    two = run_wan([*short, "parallel.tp=2", "parallel.sequence_parallel=true"], nproc=2, name="tp2sp",
                  timeout=900).check().losses()  # fmt: skip
    cp = run_wan([*short, "parallel.cp=2"], nproc=2, name="cp2", timeout=900).check().losses()
    assert sorted(one) == sorted(two) == sorted(cp) == [1, 2, 3]
    assert all(abs(one[s] - two[s]) < 1e-4 for s in one), (one, two)
    assert all(abs(one[s] - cp[s]) < 1e-5 for s in one), (one, cp)


def test_wan_starts_from_a_diffusers_directory_as_from_its_converted_checkpoint(run_wan, tmp_path):
    """train.init_from=<diffusers dir> loads online; the same weights converted offline give the
    same losses, and the run's checkpoints record the diffusers config (for export)."""
    diffusers = pytest.importorskip("diffusers")
    import torch

    from loong_ckpt.diffusion import diffusers_to_mcore

    torch.manual_seed(0)
    ref = diffusers.WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=24,
                                          in_channels=4, out_channels=4, text_dim=32, freq_dim=32, ffn_dim=96,
                                          num_layers=2, cross_attn_norm=True, rope_max_seq_len=1024)  # fmt: skip
    ref.save_pretrained(tmp_path / "hf")
    diffusers_to_mcore(tmp_path / "hf", tmp_path / "ckpt", progress=False)
    short = ["train.steps=2", "train.eval_iters=0"]
    online = run_wan([*short, f"train.init_from={tmp_path / 'hf'}"], name="online").check()
    offline = run_wan([*short, f"train.init_from={tmp_path / 'ckpt'}", "train.save_final=false"], name="offline").check()
    a, b = online.losses(), offline.losses()
    assert sorted(a) == sorted(b) == [1, 2]
    assert a[1] == b[1] and abs(a[2] - b[2]) < 1e-6, (a, b)
    meta = json.loads((online.out_dir / "checkpoints" / "step_00000002" / "loong.json").read_text())
    assert meta["hf_config"]["_class_name"] == "WanTransformer3DModel"
