"""An output directory holds one run: a fresh run refuses another run's directory, and a resumed
run must be the same run, with a changed LR schedule chosen explicitly."""

from dataclasses import dataclass, field

import pytest

from loong_ckpt.run_dir import (
    RunDirError,
    check_fresh_output_dir,
    check_resume,
    clear_run_outputs,
    flatten_config,
)


@dataclass
class Foundation:
    hidden_size: int = 64
    layers: tuple = (1, 2)


@dataclass
class Cfg:
    foundation: Foundation = field(default_factory=Foundation)
    lr: float = 3e-4


def test_flatten_config_gives_dotted_keys_and_json_values():
    assert flatten_config(Cfg()) == {"foundation.hidden_size": 64, "foundation.layers": [1, 2], "lr": 3e-4}


def test_a_fresh_run_refuses_a_directory_holding_another_run_and_names_the_ways_forward(tmp_path):
    assert check_fresh_output_dir(tmp_path / "new", overwrite=False) is None
    (tmp_path / "checkpoints" / "step_00000004").mkdir(parents=True)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    with pytest.raises(RunDirError) as e:
        check_fresh_output_dir(tmp_path, overwrite=False)
    msg = str(e.value)
    assert f"train.output_dir={tmp_path} holds another run (1 checkpoints up to step_00000004, metrics.jsonl (2" in msg
    for way in ("resume=true", "train.output_dir=<new dir>", "train.overwrite=true"):
        assert way in msg
    assert check_fresh_output_dir(tmp_path, overwrite=True).startswith("1 checkpoints")
    clear_run_outputs(tmp_path)
    assert check_fresh_output_dir(tmp_path, overwrite=False) is None


def test_resume_refuses_another_model_and_names_the_difference():
    stored = {"model.foundation.hidden_size": 64, "train.steps": 20, "parallel.tp": 1}
    with pytest.raises(RunDirError, match=r"model\.foundation\.hidden_size: 64 in the checkpoint, 128 now"):
        check_resume("ckpt", stored, {**stored, "model.foundation.hidden_size": 128}, "refuse")


@pytest.mark.parametrize("choice", ["refuse", "rescale", "keep"])
def test_a_longer_run_needs_an_explicit_schedule_choice(choice):
    stored = {"train.steps": 20, "parallel.tp": 1}
    current = {"train.steps": 80, "parallel.tp": 2}
    if choice == "refuse":
        with pytest.raises(RunDirError, match=r"train\.steps: 20 in the checkpoint, 80 now.*rescale.*keep"):
            check_resume("ckpt", stored, current, choice)
    else:  # the rest (a new layout) is returned for the log
        assert check_resume("ckpt", stored, current, choice) == {"parallel.tp": (1, 2)}
