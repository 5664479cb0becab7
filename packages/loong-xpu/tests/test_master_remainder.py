"""loong_xpu.master_remainder: an fp32 master as its bf16 weight and low 16 bits, Transformer
Engine's layout: the pair gives every fp32 bit pattern back, and the weight is the master rounded
to nearest with ties away from zero (round to nearest even but at exact ties)."""

import pytest
import torch

from loong_xpu.master_remainder import join_master, split_master_


def _every_high_half_with_hard_low_halves() -> torch.Tensor:
    high = torch.arange(1 << 16, dtype=torch.int64)
    low = torch.tensor([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFE, 0xFFFF, 12345], dtype=torch.int64)
    bits = (high[:, None] * (1 << 16) + low[None, :]).reshape(-1)
    return torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32)  # as int32 bit patterns


def _split(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    weight = torch.empty(master.shape, dtype=torch.bfloat16, device=master.device)
    remainder = torch.empty(master.shape, dtype=torch.int16, device=master.device)
    split_master_(master.clone(), weight, remainder)
    return weight, remainder


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_weight_and_low_half_give_back_every_fp32_bit_pattern(device):
    bits = _every_high_half_with_hard_low_halves().to(device)  # zeros, subnormals, negatives, inf, NaN too
    weight, remainder = _split(bits.view(torch.float32))
    joined = torch.empty(bits.shape, dtype=torch.float32, device=device)
    join_master(weight, remainder, joined)
    assert torch.equal(joined.view(torch.int32), bits)
    assert torch.equal(remainder.to(torch.int64) & 0xFFFF, bits.to(torch.int64) & 0xFFFF)
    if device == "cuda":  # the device's rounding is the host's
        assert torch.equal(weight.cpu().view(torch.int16), _split(bits.cpu().view(torch.float32))[0].view(torch.int16))


def test_the_weight_is_rounded_to_nearest_ties_away_as_tes_fused_adam_rounds_it():
    bits = _every_high_half_with_hard_low_halves()
    master = bits.view(torch.float32)
    weight, _ = _split(master)
    unsigned = bits.to(torch.int64) & 0xFFFFFFFF
    expected = ((unsigned >> 16) + ((unsigned & 0xFFFF) >= 0x8000).to(torch.int64)) & 0xFFFF
    assert torch.equal(weight.view(torch.int16).to(torch.int64) & 0xFFFF, expected)
    finite = torch.isfinite(master) & torch.isfinite(weight.float())
    differs = (weight.view(torch.int16) != master.bfloat16().view(torch.int16)) & finite
    assert differs.any()  # round to nearest even rounds half of the exact ties down
    assert ((unsigned[differs] & 0xFFFF) == 0x8000).all()  # and differs nowhere else


@pytest.mark.parametrize("shape", [(1000,), (7, 11)])
def test_random_masters_of_any_shape_round_trip(shape):
    master = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 1e-3
    weight, remainder = _split(master)
    joined = torch.empty(shape, dtype=torch.float32)
    join_master(weight, remainder, joined)
    assert torch.equal(joined, master)
    assert (weight.float() - master).abs().max() <= master.abs().max() * 2**-8
