"""loong_xpu.grad_scale: megatron's gradient-buffer scaling in one multi-tensor kernel, same products."""

from types import SimpleNamespace

import pytest
import torch
from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBuffer

from loong_xpu import apply_patches, get_accelerator
from loong_xpu.grad_scale import scale_by_device_scalar_, scale_gradients


def _buffer(device: str = "cpu") -> SimpleNamespace:
    g = torch.Generator().manual_seed(0)
    return SimpleNamespace(grad_data=torch.randn(4099, generator=g).to(device, torch.bfloat16),
                           extra_main_grads=[torch.randn(37, generator=g).to(device)])  # fmt: skip


def _clone(buf: SimpleNamespace) -> SimpleNamespace:
    return SimpleNamespace(grad_data=buf.grad_data.clone(), extra_main_grads=[g.clone() for g in buf.extra_main_grads])


@pytest.mark.parametrize("factor", [0.37, torch.tensor(1 / 4099)], ids=["float", "host-tensor"])
def test_host_scalars_scale_the_buffer_exactly_as_megatron_does(factor):
    ours, theirs = _buffer(), _buffer()
    scale_gradients(ours, factor)
    _ParamAndGradBuffer.scale_gradients(theirs, factor)
    assert torch.equal(ours.grad_data, theirs.grad_data)
    assert torch.equal(ours.extra_main_grads[0], theirs.extra_main_grads[0])


def test_a_device_scalar_is_rounded_to_each_dtype_before_the_multiply_as_tensoriterator_does():
    # (on the host a 0-dim tensor is read at full precision; on a device TensorIterator first casts
    # it to the common dtype: that is the product scale_by_device_scalar_ reproduces everywhere)
    a, b = torch.randn(1000, dtype=torch.bfloat16), torch.randn(10)
    scale = torch.tensor(1 / 3)
    want_a, want_b = a * scale.to(torch.bfloat16), b * scale
    scale_by_device_scalar_([a, b], scale)
    assert torch.equal(a, want_a) and torch.equal(b, want_b)
    assert not torch.equal(a, (a.float() * (1 / 3)).bfloat16())  # the rounding of the scalar shows


def test_the_manifest_puts_it_in_place_of_megatrons_method_and_takes_it_away_again():
    # (an on_cuda patch: the CUDA backend's manifest run has it too, test_patches checks that list)
    original = _ParamAndGradBuffer.scale_gradients
    patches = apply_patches(get_accelerator("cpu"))
    try:
        assert _ParamAndGradBuffer.scale_gradients is scale_gradients
        buf = _buffer()
        _ParamAndGradBuffer.scale_gradients(buf, 0.5)
        assert torch.equal(buf.grad_data, _buffer().grad_data * 0.5)
    finally:
        patches.remove()
    assert _ParamAndGradBuffer.scale_gradients is original


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_a_device_token_count_gives_megatrons_products_in_a_fraction_of_the_time():
    buf = _buffer("cuda")
    scale = torch.tensor(1 / 4099, device="cuda")
    ours, theirs = _clone(buf), _clone(buf)
    scale_gradients(ours, scale)
    _ParamAndGradBuffer.scale_gradients(theirs, scale)
    assert torch.equal(ours.grad_data, theirs.grad_data)
    assert torch.equal(ours.extra_main_grads[0], theirs.extra_main_grads[0])
    # time both on a buffer of llama3.2-1b's size (1.236e9 bf16 gradients)
    big = SimpleNamespace(grad_data=torch.ones(1_235_814_400, device="cuda", dtype=torch.bfloat16), extra_main_grads=[])
    times = {}
    for name, fn in (("megatron", _ParamAndGradBuffer.scale_gradients), ("loong", scale_gradients)):
        fn(big, scale)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            fn(big, scale)
        end.record()
        torch.cuda.synchronize()
        times[name] = start.elapsed_time(end) / 5
    print(f"scale_gradients of 1.236e9 bf16: megatron {times['megatron']:.2f} ms, loong {times['loong']:.2f} ms")
    assert times["loong"] < times["megatron"]
