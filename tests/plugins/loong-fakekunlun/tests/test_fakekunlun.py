"""The out-of-tree backend, in process: found by entry point, its collective backend carries every
megatron group, its patch joins the manifest and is undone, unsupported features are refused."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from loong_fakekunlun import FakeKunlunAccelerator

from loong_xpu import FEATURES, backend_names, get_accelerator
from loong_xpu.testing import megatron_world


def test_the_backend_is_found_through_its_entry_point_with_its_own_names():
    accel = get_accelerator("fakekunlun")
    assert "fakekunlun" in backend_names() and isinstance(accel, FakeKunlunAccelerator)
    assert (accel.name, accel.dist_backend) == ("fakekunlun", "fakebkcl")
    assert accel.describe() == "fakekunlun (cpu, 1 device(s), fakebkcl)"


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto picks CUDA on a GPU machine")
def test_auto_still_takes_the_cpu_with_the_plugin_installed(monkeypatch):
    monkeypatch.delenv("LOONG_DEVICE", raising=False)
    assert get_accelerator().name == "cpu"


@pytest.mark.parametrize("feature", FEATURES)
def test_every_optional_feature_is_refused_naming_backend_feature_and_key(feature):
    accel = FakeKunlunAccelerator()
    assert not accel.supports(feature)
    with pytest.raises(ValueError, match=rf"^some\.key: the 'fakekunlun' accelerator does not support '{feature}'"):
        accel.require(feature, "some.key")


def _megatron_groups() -> dict[str, object]:
    from megatron.core import parallel_state as mpu

    getters = ["tensor_model_parallel", "pipeline_model_parallel", "data_parallel", "context_parallel",
               "model_parallel", "expert_model_parallel", "expert_tensor_parallel", "expert_data_parallel",
               "tensor_and_data_parallel", "embedding", "position_embedding"]  # fmt: skip
    return {name: getattr(mpu, f"get_{name}_group")() for name in getters}


def test_a_megatron_world_on_it_uses_fakebkcl_for_every_group_and_its_rng_tracker():
    from megatron.core.tensor_parallel import random as mrandom

    accel = FakeKunlunAccelerator()
    stock_tracker = mrandom.CudaRNGStatesTracker
    with megatron_world(accel):
        assert dist.get_backend() == "fakebkcl"
        groups = _megatron_groups()
        assert {name: dist.get_backend(g) for name, g in groups.items()} == dict.fromkeys(groups, "fakebkcl")
        tracker = mrandom.get_cuda_rng_tracker()
        assert type(tracker).__name__ == "FakeKunlunRNGStatesTracker"
        with tracker.fork():
            torch.rand(2)
        t = torch.ones(4)
        dist.all_reduce(t, group=groups["tensor_model_parallel"])
        assert t.tolist() == [1.0] * 4
    assert mrandom.CudaRNGStatesTracker is stock_tracker  # the backend's patch was undone with the rest
    assert accel.calls["prepare_distributed"] == 1 and accel.calls["set_device"] == 1
    assert accel.calls["rng_tracker.fork"] >= 1 and accel.calls["manual_seed"] >= 1
    assert accel.calls["get_rng_state"] >= 1 and accel.calls["set_rng_state"] >= 1


def test_megatron_streams_events_and_memory_queries_reach_the_backend():
    accel = FakeKunlunAccelerator()
    with megatron_world(accel):
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            e = torch.cuda.Event()
            e.record()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        assert torch.cuda.max_memory_allocated() >= torch.cuda.memory_allocated() > 0
    for seam in ("stream.create", "stream.enter", "event.record", "current_stream", "stream.wait_stream",
                 "synchronize", "memory_stats"):  # fmt: skip
        assert accel.calls[seam] >= 1, seam
