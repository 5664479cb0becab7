"""Checkpoints a run can trust, through the real train app and loong-convert: damaged checkpoints
are found and skipped, crafted ones run nothing, a NaN run stops, another run's directory is
never overwritten by accident, and a longer resumed run says what happens to its LR schedule."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from loong_ckpt.integrity import hash_files, listed_files
from loong_ckpt.mcore_io import Chunk, read_metadata, read_regions, write_checkpoint
from loong_ckpt.safe_load import read_dcp_metadata
from loong_ckpt.training import META_FILE
from loong_xpu.testing import launch_env

STEPS = 6
BASE = [f"train.steps={STEPS}", "train.save_interval=2", "train.eval_interval=0", "train.keep_last=10"]


@pytest.fixture(scope="module")
def base(tmp_path_factory, runner_factory):
    """A finished run with checkpoints at steps 2, 4, 6, and a runner writing next to it."""
    run = runner_factory(tmp_path_factory.mktemp("trust"))
    done = run(BASE, name="base").check()
    return run, done


def _copy(done, name):
    out = done.out_dir.parent / name
    shutil.copytree(done.out_dir, out)
    return out


def _ckpt(out, step):
    return out / "checkpoints" / f"step_{step:08d}"


def _rehash(ckpt):
    """What someone able to write the directory can do: make loong.json agree with the files."""
    meta = json.loads((ckpt / META_FILE).read_text())
    meta["files"] = hash_files(ckpt, listed_files(ckpt, META_FILE))
    (ckpt / META_FILE).write_text(json.dumps(meta))


def test_damaged_checkpoints_are_skipped_and_resume_continues_bit_identically(base):
    run, done = base
    out = _copy(done, "damaged")
    (_ckpt(out, 6) / META_FILE).write_text('{"format_version": 2, "st')  # cut short
    shard = next(_ckpt(out, 4).glob("*.distcp"))
    with open(shard, "r+b") as f:  # 100 KB of random bytes inside the weights
        f.seek(shard.stat().st_size // 3)
        f.write(os.urandom(100_000))
    resumed = run([*BASE, "resume=true", "train.keep_last=1"], name="damaged").check()
    assert f"{shard}: sha256" in resumed.stderr and "not readable checkpoint metadata" in resumed.stderr
    assert "the newest checkpoint that verifies" in resumed.stderr and "(step 2)" in resumed.stderr
    assert _ckpt(out, 4).with_name("step_00000004.corrupt").is_dir()
    assert _ckpt(out, 6).with_name("step_00000006.corrupt").is_dir()
    want, got = done.losses(), resumed.losses()
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(3, STEPS + 1):
        assert abs(got[step] - want[step]) <= 1e-5, (step, got[step], want[step])


class Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def _craft_rng_item(ckpt, marker):
    """Point the checkpoint's RNG-state item at a pickle that calls os.mkdir(marker)."""
    import io
    import pickle

    from torch.distributed.checkpoint.filesystem import _StorageInfo

    md = read_dcp_metadata(ckpt)
    index = next(i for i in md.storage_data if i.fqn.startswith("rng_state"))
    info = md.storage_data[index]
    buf = io.BytesIO()
    torch.save([Payload(marker)], buf)
    offset = (ckpt / info.relative_path).stat().st_size
    with open(ckpt / info.relative_path, "ab") as f:
        f.write(buf.getvalue())
    md.storage_data[index] = _StorageInfo(info.relative_path, offset, len(buf.getvalue()))
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    _rehash(ckpt)


def test_crafted_checkpoints_run_nothing_on_resume_init_from_or_conversion(base, tmp_path):
    run, done = base
    marker = tmp_path / "pwned"
    out = _copy(done, "crafted")
    _craft_rng_item(_ckpt(out, 6), marker)
    resumed = run([*BASE, "resume=true"], name="crafted")
    assert resumed.returncode != 0 and "refused by the weights-only unpickler" in resumed.stderr
    init = run([*BASE, f"train.init_from={_ckpt(out, 6)}"], name="crafted-init")
    assert init.returncode != 0 and "refused by the weights-only unpickler" in init.stderr
    evil = _ckpt(out, 4)
    import pickle

    (evil / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": Payload(marker)}))
    _rehash(evil)
    convert = subprocess.run([sys.executable, "-m", "loong_ckpt.cli", "mcore-to-hf", str(evil), str(tmp_path / "hf")],
                             env=launch_env(), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert convert.returncode == 2 and "refers to posix.mkdir" in convert.stderr, convert.stderr[-2000:]
    assert not marker.exists(), "code from a checkpoint ran"


def _nan_weights_checkpoint(src, dst, key="decoder.final_layernorm.weight"):
    """``src``'s model weights with ``key`` set to NaN, written as a complete checkpoint."""
    meta = json.loads((src / META_FILE).read_text())
    stored = {k: v for k, v in read_metadata(src).items() if not k.startswith("optimizer")}
    objects = [k for k, v in read_dcp_metadata(src).state_dict_metadata.items()
               if isinstance(v, BytesStorageMetadata) and "_extra_state" in k]  # fmt: skip
    chunks = [Chunk(k, tuple(v.size), (0,) * len(v.size), tuple(v.size), v.properties.dtype) for k, v in stored.items()]

    def compute(c):
        buf = torch.empty(c.sizes, dtype=c.dtype)
        read_regions(src, {c.key: (c.offsets, buf)})
        return buf.fill_(float("nan")) if c.key == key else buf

    dst.mkdir()
    write_checkpoint(dst, chunks, objects, compute)
    meta.update(files=hash_files(dst, listed_files(dst, META_FILE)), layout=None)
    (dst / META_FILE).write_text(json.dumps(meta))
    return dst


def test_nan_run_skips_each_step_then_stops_with_an_error_and_overwrite_replaces_the_old_run(base, tmp_path):
    run, done = base
    nan = _nan_weights_checkpoint(_ckpt(done.out_dir, 2), tmp_path / "nan")
    out = _copy(done, "nan-run")
    args = [*BASE, f"train.init_from={nan}", "train.nonfinite_limit=3"]
    refused = run(args, name="nan-run")
    assert refused.returncode != 0
    for hint in (f"train.output_dir={out} holds another run", "resume=true", "train.output_dir=", "train.overwrite=true"):
        assert hint in refused.stderr
    assert (out / "metrics.jsonl").read_text() == (done.out_dir / "metrics.jsonl").read_text()
    stopped = run([*args, "train.overwrite=true"], name="nan-run")
    assert stopped.returncode != 0
    assert "3 steps in a row (up to step 3) had a NaN / Inf loss or gradient" in stopped.stderr
    assert "Traceback" not in stopped.stderr
    records = stopped.records("train")
    assert [r["step"] for r in records] == [1, 2, 3] and all(r["skipped"] and r["nonfinite"] for r in records)
    assert not _ckpt(out, 4).exists() and not _ckpt(out, 6).exists(), "the replaced run's checkpoints are gone"


def test_resume_refuses_another_model_init_from_another_shape_and_a_silent_schedule_change(base):
    run, done = base
    out = _copy(done, "longer")
    other = run([*BASE, "resume=true", "model.foundation.ffn_hidden_size=96"], name="longer")
    assert other.returncode != 0
    assert "model.foundation.ffn_hidden_size: 128 in the checkpoint, 96 now" in other.stderr
    # init_from compares no configs: the tensors' shapes are checked before megatron reads any
    narrower = run([*BASE, f"train.init_from={_ckpt(done.out_dir, 6)}", "model.foundation.ffn_hidden_size=96"],
                   name="narrower")  # fmt: skip
    assert narrower.returncode != 0 and "Traceback" not in narrower.stderr
    assert re.search(r"checkpoint does not match the model's shapes: \S*linear_fc2\.weight: \[[\d, ]*128\] in the "
                     r"checkpoint, \[[\d, ]*96\] in the model", narrower.stderr), narrower.stderr[-2000:]  # fmt: skip
    longer = [*BASE[1:], "train.steps=10", "resume=true"]
    refused = run(longer, name="longer")
    assert refused.returncode != 0 and "train.steps: 6 in the checkpoint, 10 now" in refused.stderr
    assert "train.resume_schedule=rescale" in refused.stderr and "train.resume_schedule=keep" in refused.stderr
    rescaled = run([*longer, "train.resume_schedule=rescale"], name="longer").check()
    lr = {r["step"]: r["lr"] for r in rescaled.records("train")}  # the rate each step ran at
    # the 6-step schedule's last step ran near optim.min_lr (3e-4; keep would stay there): the 10-step
    # schedule is higher at step 7 and decays from there to the minimum at its last step
    assert lr[7] > lr[6] and lr[7] > lr[8] > lr[9] > lr[10] >= 3e-4
    assert sorted(rescaled.losses()) == list(range(1, 11)) and out.is_dir()
