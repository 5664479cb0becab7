"""The packed (THD) data path of the train app, in one process: it trains, its config keys are
checked, and the default job is unchanged."""

import pytest
from omegaconf.errors import ValidationError

from loong_train import testing
from loong_train.main import to_config
from loong_train.schema import ConfigError, validate


def compose_config(*overrides: str):
    return to_config(testing.compose_config(*overrides))


def test_default_job_keeps_fixed_packing_and_no_balancing() -> None:
    cfg = compose_config()
    assert cfg.data.packing == "fixed" and not cfg.parallel.balance.enabled


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["parallel.balance.enabled=true"], r"parallel.balance.enabled=true needs data.packing=thd"),
        (["data.packing=thd", "parallel.balance.max_tokens_per_rank=8"], r"max_tokens_per_rank=8 must be null or >="),
    ],
)
def test_packing_config_errors_name_the_key(overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        validate(compose_config(*overrides), world_size=1)


@pytest.mark.parametrize(
    "override, key, allowed",
    [("data.packing=bshd", "data.packing", "fixed, thd"), ("data.thd.strategy=best", "data.thd.strategy", "ffd, sequential")],
)
def test_packing_choices_name_the_allowed_values(override, key, allowed) -> None:
    with pytest.raises(ValidationError, match=rf"expected one of \[{allowed}\]") as e:
        compose_config(override)
    assert e.value.full_key == key


def test_thd_training_runs_and_learns(run_train) -> None:
    run = run_train(["data.packing=thd", "data.seq_length=128", "data.thd.median_length=24",
                     "data.thd.strategy=sequential", "train.steps=6", "train.eval_interval=3"]).check()
    train = run.records("train")
    assert len(train) == 6 and train[-1]["loss"] < train[0]["loss"]
    assert len(run.records("val")) == 2
