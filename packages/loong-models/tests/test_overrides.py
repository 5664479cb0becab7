"""Command-line overrides are checked against the config schema before Hydra composes them: a
misspelt key fails in one line naming the closest key; additions, deletions, group choices,
``hydra.*`` and flags are left to Hydra."""

from dataclasses import dataclass, field

import pytest

from loong_models import ModelConfig
from loong_models.overrides import check_overrides, config_groups, unknown_key

GROUPS = ("loong_models.configs",)  # ships the `model` group


@dataclass
class Run:
    model: ModelConfig = field(default_factory=ModelConfig)
    steps: int = 1


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.foundation.num_layer=2", "model.foundation.num_layer: no key 'num_layer' in model.foundation; "
                                         "did you mean model.foundation.num_layers?"),
        ("model.lora.rnk=8", "model.lora.rnk: no key 'rnk' in model.lora; did you mean model.lora.rank?"),
        ("stpes=3", "stpes: no key 'stpes' in the top level; did you mean steps? allowed: model, steps"),
        ("modle=tiny", "modle: no key 'modle' in the top level; did you mean model?"),
    ],
)  # fmt: skip
def test_a_misspelt_key_is_named_in_one_line_with_the_closest_key(override, message):
    got = check_overrides([override], Run, GROUPS)
    assert got is not None and got.startswith(message) and "\n" not in got, got


@pytest.mark.parametrize("args", [["--cfg", "job", "model=tiny"], ["+model.foundation.extra.x=1", "~steps"],
                                  ["hydra.run.dir=/tmp/x", "model/foundation=tiny"], ["model.foundation.num_layers=2"],
                                  ["model.foundation.recompute_modules=[moe]"]])  # fmt: skip
def test_valid_overrides_and_hydras_own_pass(args):
    assert check_overrides(args, Run, GROUPS) is None


def test_a_key_below_a_list_or_a_plain_value_is_left_to_the_schema_merge():
    assert unknown_key("steps.anything", Run) is None


def test_an_override_hydra_cannot_parse_is_its_first_line():
    got = check_overrides(["model.foundation.num_layers=[1,"], Run, GROUPS)
    assert got is not None and "\n" not in got


def test_the_config_groups_are_the_packages_subdirectories():
    assert config_groups(GROUPS) == {"model"}
