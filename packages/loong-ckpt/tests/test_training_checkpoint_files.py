"""Which directories count as checkpoints: only complete ones, never a half-written save."""

import json

import pytest

from loong_ckpt.training import FORMAT_VERSION, META_FILE, latest_checkpoint, read_checkpoint_info


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
    with pytest.raises(ValueError, match="format_version=99, expected 1"):
        read_checkpoint_info(d)
