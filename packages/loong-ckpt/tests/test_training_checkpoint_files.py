"""Which directories count as checkpoints: only complete ones, never a half-written save; and of
those, on resume, only one whose files still have the bytes they were written with."""

import json
import os

import pytest

from loong_ckpt.integrity import IntegrityError, hash_files, listed_files
from loong_ckpt.training import (
    FORMAT_VERSION,
    META_FILE,
    complete_checkpoints,
    latest_checkpoint,
    newest_verified_checkpoint,
    read_checkpoint_info,
    retain,
    verify_checkpoint,
)


def complete(root, step):
    d = root / f"step_{step:08d}"
    d.mkdir(parents=True)
    (d / META_FILE).write_text(json.dumps({"format_version": FORMAT_VERSION, "step": step}))
    return d


def test_partial_saves_are_never_picked(tmp_path):
    complete(tmp_path, 10)
    partial = tmp_path / "step_00000020.partial"
    partial.mkdir()
    (partial / META_FILE).write_text(json.dumps({"format_version": FORMAT_VERSION, "step": 20}))
    assert latest_checkpoint(tmp_path).step == 10
    with pytest.raises(ValueError, match="incomplete checkpoint"):
        read_checkpoint_info(partial)


def test_latest_file_wins_and_a_stale_pointer_falls_back_to_scanning(tmp_path):
    complete(tmp_path, 5)
    complete(tmp_path, 7)
    (tmp_path / "latest").write_text("step_00000005")
    assert latest_checkpoint(tmp_path).step == 5
    (tmp_path / "latest").write_text("step_00000099")  # points at a checkpoint that is gone
    assert latest_checkpoint(tmp_path).step == 7


def test_directory_without_metadata_is_not_a_checkpoint(tmp_path):
    (tmp_path / "step_00000003").mkdir()
    assert latest_checkpoint(tmp_path) is None
    with pytest.raises(FileNotFoundError, match="loong.json is missing"):
        read_checkpoint_info(tmp_path / "step_00000003")


def test_unknown_format_version_is_refused(tmp_path):
    d = complete(tmp_path, 1)
    (d / META_FILE).write_text(json.dumps({"format_version": 99, "step": 1}))
    with pytest.raises(ValueError, match="format_version=99, expected 2"):
        read_checkpoint_info(d)


def hashed(root, step, payload: bytes = b"w" * 4096):
    """A complete checkpoint with one data file and its hash, as save_checkpoint writes it."""
    d = root / f"step_{step:08d}"
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(payload)
    files = hash_files(d, listed_files(d, META_FILE))
    (d / META_FILE).write_text(json.dumps({"format_version": FORMAT_VERSION, "step": step, "files": files}))
    return d


def test_changed_or_zeroed_bytes_fail_verification_naming_the_file(tmp_path):
    d = hashed(tmp_path, 1)
    verify_checkpoint(read_checkpoint_info(d))
    data = d / "__0_0.distcp"
    data.write_bytes(b"\0" * 100 + data.read_bytes()[100:])  # same size, zeroed bytes
    with pytest.raises(IntegrityError, match=r"__0_0\.distcp: sha256 .* when written"):
        verify_checkpoint(read_checkpoint_info(d))
    data.write_bytes(b"w")
    with pytest.raises(IntegrityError, match=r"__0_0\.distcp: 1 bytes, 4096 when written"):
        verify_checkpoint(read_checkpoint_info(d))


def test_resume_falls_back_to_the_newest_checkpoint_that_verifies(tmp_path):
    hashed(tmp_path, 1)
    hashed(tmp_path, 2)
    bad = hashed(tmp_path, 3)
    (bad / "__0_0.distcp").write_bytes(os.urandom(4096))
    unreadable = hashed(tmp_path, 4)
    (unreadable / META_FILE).write_text("{not json")
    assert latest_checkpoint(tmp_path).step == 3  # the cheap scan does not hash
    assert newest_verified_checkpoint(tmp_path).step == 2
    assert (tmp_path / "step_00000003.corrupt").is_dir() and (tmp_path / "step_00000004.corrupt").is_dir()
    assert latest_checkpoint(tmp_path).step == 2, "set-aside checkpoints are never picked again"


def test_no_verifying_checkpoint_is_an_error_not_a_fresh_start(tmp_path):
    bad = hashed(tmp_path, 1)
    (bad / "__0_0.distcp").write_bytes(b"x" * 4096)
    with pytest.raises(IntegrityError, match="no checkpoint under .* verifies: step_00000001"):
        newest_verified_checkpoint(tmp_path)
    assert newest_verified_checkpoint(tmp_path / "empty") is None


def test_retention_never_deletes_the_newest_verified_checkpoint(tmp_path):
    for step in (1, 2, 3, 4):
        hashed(tmp_path, step)
    gone = retain(tmp_path, 1, verified=tmp_path / "step_00000002")
    assert [d.name for d in gone] == ["step_00000001", "step_00000003"]
    assert [d.name for d in complete_checkpoints(tmp_path)] == ["step_00000002", "step_00000004"]
