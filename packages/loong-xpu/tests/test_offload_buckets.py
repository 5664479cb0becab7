"""loong_xpu.offload_buckets: megatron's host-offloaded optimizer steps one host AdamW per bucket of
tensors, with the same updates as its one AdamW per tensor."""

import torch
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

from loong_xpu import apply_patches, get_accelerator
from loong_xpu.offload_buckets import BUCKET, TARGET, buckets


def test_tensors_are_cut_into_runs_in_order_and_a_large_one_stands_alone():
    ts = [torch.empty(n) for n in (3, 4, 2, 9, 1, 1, 5)]
    runs = buckets(ts, 8)
    assert [[t.numel() for t in r] for r in runs] == [[3, 4], [2], [9], [1, 1, 5]]
    assert [t for r in runs for t in r] == ts  # every tensor once, in order
    assert buckets([], 8) == []
    empty = torch.empty(0)
    assert [[t.numel() for t in r] for r in buckets([empty, *ts[:2]], 8)] == [[0, 3, 4]]
    assert [len(r) for r in buckets(ts, 0)] == [1] * len(ts)  # limit 0: one tensor each, as megatron builds them


def test_the_manifest_replaces_the_static_method_and_restores_it_as_one():
    stored = vars(HybridDeviceOptimizer)["build_cpu_optimizer_list"]
    assert isinstance(stored, staticmethod)
    patches = apply_patches(get_accelerator("cpu"))
    try:
        assert TARGET in patches.applied
        assert isinstance(vars(HybridDeviceOptimizer)["build_cpu_optimizer_list"], staticmethod)
    finally:
        patches.remove()
    assert vars(HybridDeviceOptimizer)["build_cpu_optimizer_list"] is stored
    # still callable without an instance, as megatron calls it
    assert HybridDeviceOptimizer.build_cpu_optimizer_list(torch.optim.AdamW, []) == []


def _groups(seed: int):
    """Two parameter groups (megatron's: with and without weight decay) of host fp32 masters."""
    g = torch.Generator().manual_seed(seed)
    decayed = [torch.randn(n, generator=g) for n in (BUCKET // 2, 1000, BUCKET // 2, 77)]
    plain = [torch.randn(n, generator=g) for n in (5, 6)]
    return [{"params": decayed, "weight_decay": 0.1, "lr": 1e-2}, {"params": plain, "weight_decay": 0.0, "lr": 3e-2}]


def _train(build, steps: int = 3):
    groups = _groups(0)
    optimizers = build(torch.optim.AdamW, groups)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for group in groups:
            for p in group["params"]:
                p.grad = torch.randn(p.shape, generator=g)
        for o in optimizers:
            o.step()
    return optimizers, [p for group in groups for p in group["params"]]


def test_buckets_step_the_same_weights_as_one_optimizer_per_tensor():
    theirs, their_weights = _train(HybridDeviceOptimizer.build_cpu_optimizer_list)
    patches = apply_patches(get_accelerator("cpu"))
    try:
        ours, our_weights = _train(HybridDeviceOptimizer.build_cpu_optimizer_list)
    finally:
        patches.remove()
    assert len(theirs) == 6
    # the first two tensors fill a bucket; the third starts the next, which takes the small last one
    assert [[p.numel() for p in o.param_groups[0]["params"]] for o in ours] == [[BUCKET // 2, 1000], [BUCKET // 2, 77], [5, 6]]
    assert [(o.param_groups[0]["lr"], o.param_groups[0]["weight_decay"]) for o in ours] == [(1e-2, 0.1), (1e-2, 0.1), (3e-2, 0.0)]
    for a, b in zip(their_weights, our_weights, strict=True):
        assert torch.equal(a, b)
