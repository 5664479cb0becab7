import pytest
import torch

from loong_xpu import MANIFEST, apply_patches, get_accelerator, redirect_cuda
from loong_xpu.patches import _resolve


def test_every_patch_names_a_real_target_and_a_reason():
    assert len({p.target for p in MANIFEST}) == len(MANIFEST)
    for patch in MANIFEST:
        owner, attr = _resolve(patch.target)
        assert hasattr(owner, attr), patch.target
        assert len(patch.reason) > 10


def test_cuda_calls_land_on_the_cpu_and_everything_is_restored():
    originals = {p.target: getattr(*_resolve(p.target)) for p in MANIFEST}
    with redirect_cuda(get_accelerator("cpu")) as patches:
        assert len(patches.applied) == len(MANIFEST) + 1
        assert torch.cuda.current_device() == 0
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert torch.empty(2, device=torch.cuda.current_device()).device.type == "cpu"
        assert torch.ones(1).cuda().device.type == "cpu"
        assert torch.ones(1).to("cuda").device.type == "cpu"
        assert torch.nn.Linear(2, 2).cuda().weight.device.type == "cpu"
        assert torch.ones(1).type() == "torch.cuda.FloatTensor"  # what megatron asserts on
        torch.cuda.synchronize()
        stream = torch.cuda.current_stream()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        stream.wait_event(event)
        with torch.cuda.stream(torch.cuda.Stream()):
            pass
        state = torch.cuda.get_rng_state()
        x = torch.rand(4)
        torch.cuda.set_rng_state(state)
        assert torch.equal(torch.rand(4), x)
    for target, original in originals.items():
        assert getattr(*_resolve(target)) is original, target
    assert torch.ones(1).type() == "torch.FloatTensor"


def test_patching_twice_is_refused_and_leaves_nothing_half_done():
    acc = get_accelerator("cpu")
    first = apply_patches(acc)
    try:
        with pytest.raises(RuntimeError, match="already patched"):
            apply_patches(acc)
        assert torch.zeros(1, device="cuda").device.type == "cpu"  # the first set still works
    finally:
        first.remove()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
def test_cuda_backend_patches_nothing():
    patches = apply_patches(get_accelerator("cuda"))
    assert patches.applied == []
