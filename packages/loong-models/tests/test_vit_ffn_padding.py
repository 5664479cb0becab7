"""The ViT's MLP padded to an aligned width (``pad_ffn_to``) is the unpadded ViT exactly: same
output, same gradients on the real units, zero gradients (and so zero weights after AdamW with
weight decay) on the padding. fp32, CPU, local backend."""

import dataclasses

import pytest
import torch

from loong_models import ImageEncoderConfig
from loong_models.specs import te_installed
from loong_models.testing import build_vision

FFN = 40  # not a multiple of 64: padded to 64


def _configs(type_: str) -> tuple[ImageEncoderConfig, ImageEncoderConfig]:
    extra = dict(window_size=56, fullatt_block_indexes=[1]) if type_ == "qwen2.5-vit" else {}
    base = ImageEncoderConfig(type=type_, num_layers=2, hidden_size=32, ffn_hidden_size=FFN, num_attention_heads=2,
                              temporal_patch_size=2 if type_ == "qwen2.5-vit" else 1, image_size=56, **extra)  # fmt: skip
    return dataclasses.replace(base, pad_ffn_to=1), dataclasses.replace(base, pad_ffn_to=64)


def _mlp_names(state: dict[str, torch.Tensor]) -> list[str]:
    """The MLP's linear weights and biases (not TE's fused pre-MLP norm, ``linear_fc1.layer_norm_*``)."""
    return [
        k for k in state if ".mlp.linear_fc" in k and not k.endswith("_extra_state") and "layer_norm" not in k
    ]


def _padded_copy(plain: torch.nn.Module, padded: torch.nn.Module, gated: bool) -> None:
    """Load the plain encoder's weights into the padded one (its padding stays as built)."""
    src, dst = plain.state_dict(), padded.state_dict()
    with torch.no_grad():
        for name, t in src.items():
            if name.endswith("_extra_state"):
                continue
            d = dst[name]
            if d.shape == t.shape:
                d.copy_(t)
            elif "linear_fc1" in name:
                halves = 2 if gated else 1
                d.view(halves, -1, *d.shape[1:])[:, :FFN].copy_(t.view(halves, FFN, *t.shape[1:]))
            else:
                d[:, :FFN].copy_(t)


def _real(t: torch.Tensor, name: str, gated: bool) -> torch.Tensor:
    if "linear_fc1" in name:
        halves = 2 if gated else 1
        return t.view(halves, -1, *t.shape[1:])[:, :FFN].reshape(-1, *t.shape[1:])
    return t[:, :FFN] if name.endswith("linear_fc2.weight") else t


def _padding(t: torch.Tensor, name: str, gated: bool) -> torch.Tensor:
    if "linear_fc1" in name:
        halves = 2 if gated else 1
        return t.view(halves, -1, *t.shape[1:])[:, FFN:]
    return t[:, FFN:] if name.endswith("linear_fc2.weight") else t[:0]


def test_qwen25_vit_pads_its_mlp_to_64_by_default():
    cfg = ImageEncoderConfig(type="qwen2.5-vit", ffn_hidden_size=3420)
    assert cfg.padded_ffn_hidden_size == 3456
    assert dataclasses.replace(cfg, pad_ffn_to=1).padded_ffn_hidden_size == 3420
    assert ImageEncoderConfig(type="siglip", ffn_hidden_size=4304).padded_ffn_hidden_size == 4304
    with pytest.raises(ValueError, match=r"model.image_encoder.pad_ffn_to=0 must be >= 1"):
        dataclasses.replace(cfg, pad_ffn_to=0).validate()


@pytest.mark.parametrize("type_", ["qwen2.5-vit", "siglip"])
def test_padded_mlp_gives_the_same_output_and_gradients_and_its_padding_stays_zero(megatron_cpu, type_):
    torch.manual_seed(0)
    plain_cfg, padded_cfg = _configs(type_)
    gated = type_ == "qwen2.5-vit"
    plain, _ = build_vision(plain_cfg)
    padded, _ = build_vision(padded_cfg)
    with torch.no_grad():  # biases start at 0: randomise them so the padding's zero bias is tested
        for p in plain.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    _padded_copy(plain, padded, gated)
    grid = torch.tensor([[1, 4, 8], [2, 4, 4]] if gated else [[1, 4, 4], [1, 4, 6]])
    pixels = torch.randn(int(grid.prod(-1).sum()), plain_cfg.patch_dim)
    opt = torch.optim.AdamW(padded.parameters(), lr=0.1, weight_decay=0.1)
    for step in range(2):
        outs = []
        for m in (plain, padded):
            m.zero_grad()
            out = m(pixels, grid)
            (out * torch.linspace(-1, 1, out.shape[-1])).square().sum().backward()
            outs.append(out)
        assert (outs[0] - outs[1]).abs().max() <= 1e-5, step
        grads_plain = {n: p.grad for n, p in plain.named_parameters()}
        names = _mlp_names(dict(padded.named_parameters()))
        assert names and all(padded.get_parameter(n).shape != plain.get_parameter(n).shape for n in names
                             if not n.endswith("linear_fc2.bias"))  # fmt: skip
        for n, p in padded.named_parameters():
            assert torch.allclose(_real(p.grad, n, gated), grads_plain[n], atol=1e-5, rtol=1e-5), n
            assert not _padding(p.grad, n, gated).any(), n  # exactly zero
        opt.step()
        for n in names:
            assert not _padding(padded.get_parameter(n), n, gated).any(), n
        _padded_copy(plain, padded, gated)  # both continue from the same weights


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or not te_installed(), reason="needs CUDA and transformer-engine"
)
def test_te_vit_builds_its_padding_zero_and_its_gradients_there_are_zero_on_cuda():
    """TE layers (bf16, the fused norm + fc1 and fc2 that training runs): the padding is zero as
    built and after AdamW steps, its gradients exactly zero; the real width is ffn_hidden_size."""
    from loong_xpu import get_accelerator
    from loong_xpu.testing import megatron_world

    with megatron_world(get_accelerator("cuda")):
        torch.manual_seed(0)
        cfg = dataclasses.replace(_configs("qwen2.5-vit")[1], pad_ffn_to=None, ffn_hidden_size=3420 // 36)
        assert cfg.padded_ffn_hidden_size == 128  # 95 -> 128 (the type's 64)
        encoder, _ = build_vision(cfg, backend="te", dtype=torch.bfloat16)
        encoder = encoder.cuda()
        params = dict(encoder.named_parameters())
        names = [n for n in _mlp_names(params) if not n.endswith("linear_fc2.bias")]
        assert {params[n].shape[0 if "fc1" in n else 1] for n in names} == {256, 128}
        real = cfg.ffn_hidden_size

        def pad(t: torch.Tensor, name: str) -> torch.Tensor:
            return t.view(2, -1, *t.shape[1:])[:, real:] if "fc1" in name else t[:, real:]

        assert all(not pad(params[n], n).any() for n in names)
        opt = torch.optim.AdamW(encoder.parameters(), lr=0.1, weight_decay=0.1)
        grid = torch.tensor([[1, 8, 8], [2, 4, 8]])
        pixels = torch.randn(int(grid.prod(-1).sum()), cfg.patch_dim, device="cuda")
        for _ in range(2):
            opt.zero_grad()
            encoder(pixels, grid).float().square().mean().backward()
            assert all(not pad(params[n].grad, n).any() for n in names)
            assert all(params[n].grad[:real].abs().sum() > 0 for n in names if "fc1" in n)
            opt.step()
        assert all(not pad(params[n], n).any() for n in names)
