"""Classes in optimizer param groups (megatron's HybridDeviceOptimizer) survive the weights-only
loader as names, and only the running optimizer's own classes come back."""

import io

import pytest
import torch

from loong_ckpt.class_names import classes_in, classes_to_names, names_to_classes
from loong_ckpt.safe_load import UnsafeCheckpointError, load_weights_only


def _groups():
    return {"param_groups": [{"lr": 1e-3, "cpu_optimizer_cls": torch.optim.AdamW, "params": [0, 1]}],
            "state": {0: {"exp_avg": torch.ones(2)}}}  # fmt: skip


def _bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_param_groups_holding_a_class_are_refused_as_they_are_and_load_as_names():
    with pytest.raises(UnsafeCheckpointError, match="refused by the weights-only unpickler"):
        load_weights_only(_bytes(_groups()), "common.pt")
    named = classes_to_names(_groups())
    loaded = load_weights_only(_bytes(named), "common.pt")
    assert loaded["param_groups"][0]["cpu_optimizer_cls"] == "class:torch.optim.adamw.AdamW"
    assert torch.equal(loaded["state"][0]["exp_avg"], torch.ones(2))


def test_only_classes_the_running_optimizer_holds_come_back():
    live = [{"cpu_optimizer_cls": torch.optim.AdamW, "lr": 1e-3}]
    stored = {"param_groups": [{"cpu_optimizer_cls": "class:torch.optim.adamw.AdamW",
                                "gpu_optimizer_cls": "class:os.system", "lr": 1e-3}]}  # fmt: skip
    back = names_to_classes(stored, classes_in(live))
    assert back["param_groups"][0]["cpu_optimizer_cls"] is torch.optim.AdamW
    assert back["param_groups"][0]["gpu_optimizer_cls"] == "class:os.system"  # never imported
    assert back["param_groups"][0]["lr"] == 1e-3


def test_the_tree_is_copied_not_changed():
    groups = _groups()
    classes_to_names(groups)
    assert groups["param_groups"][0]["cpu_optimizer_cls"] is torch.optim.AdamW
