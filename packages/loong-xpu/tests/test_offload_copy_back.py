"""loong_xpu.offload_copy_back: megatron's host-offloaded optimizer copies its updated weights back
from pinned masters, cast on the device; same weights as megatron's own copy (with
loong_xpu.offload_buckets' host optimizers, also part of the manifest)."""

import pytest
import torch
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

from loong_xpu import apply_patches, get_accelerator
from loong_xpu.offload_copy_back import TARGET, PinnedCopyBack
from loong_xpu.testing import train_hybrid_device_optimizer


def test_the_manifest_wraps_megatrons_hook_registration_and_takes_it_away_again():
    original = HybridDeviceOptimizer._register_param_copy_back_gpu_hook
    patches = apply_patches(get_accelerator("cpu"))
    try:
        assert TARGET in patches.applied
        assert HybridDeviceOptimizer._register_param_copy_back_gpu_hook.__wrapped__ is original
    finally:
        patches.remove()
    assert HybridDeviceOptimizer._register_param_copy_back_gpu_hook is original


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("offload_fraction", [1.0, 0.5])
def test_pinned_copies_give_megatrons_weights(offload_fraction):
    theirs, their_opt = train_hybrid_device_optimizer(offload_fraction, patched=False)
    ours, opt = train_hybrid_device_optimizer(offload_fraction, patched=True)
    for a, b in zip(theirs, ours, strict=True):
        assert torch.equal(a, b)
    # megatron: one host AdamW per offloaded tensor; with loong_xpu.offload_buckets they share one
    assert len(their_opt.cpu_optimizers) == {1.0: 4, 0.5: 2}[offload_fraction] and len(opt.cpu_optimizers) == 1
    hooks = [h for o in opt.cpu_optimizers for h in o._optimizer_step_post_hooks.values()]
    assert len(hooks) == len(opt.cpu_optimizers) and all(isinstance(h, PinnedCopyBack) for h in hooks)
    masters = [m for o in opt.cpu_optimizers for g in o.param_groups for m in g["params"]]
    assert all(m.is_pinned() and m.dtype == torch.float32 for m in masters)  # pinned in place, still fp32
    assert all(opt.cpu_copys_map_gpu_param[m].dtype == torch.bfloat16 for m in masters)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_tensor_larger_than_a_chunk_is_cast_on_the_device_piece_by_piece(monkeypatch):
    from loong_xpu import offload_copy_back

    monkeypatch.setattr(offload_copy_back, "CHUNK", 1000)  # 4,099 elements: four full chunks and a rest
    master = torch.randn(4099, generator=torch.Generator().manual_seed(0)).pin_memory()
    weight = torch.zeros(4099, device="cuda", dtype=torch.bfloat16)
    offload_copy_back.copy_to_device(master, weight)
    torch.cuda.synchronize()
    assert torch.equal(weight.cpu(), master.bfloat16())  # the host's rounding, from the device's cast
