"""The ViTs against HF transformers, built from config classes with random weights, fp32."""

import dataclasses

import pytest
import torch

from loong_models import ImageEncoderConfig, ImageProjectorConfig
from loong_models.image_encoder.grid import patch_coordinates
from loong_models.specs import te_installed
from loong_models.testing import (
    build_vision,
    image_to_patches,
    load_exact,
    qwen_vit_state,
    siglip_state,
    te_names,
)
from loong_xpu import get_accelerator
from loong_xpu.testing import megatron_world

HEADS, DEPTH = 4, 3


def qwen_configs():
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig

    hf = Qwen2_5_VLVisionConfig(depth=DEPTH, hidden_size=64, intermediate_size=96, num_heads=HEADS,
                                out_hidden_size=48, patch_size=14, temporal_patch_size=2, spatial_merge_size=2,
                                window_size=56, fullatt_block_indexes=[1], hidden_act="silu")  # fmt: skip
    ours = ImageEncoderConfig(type="qwen2.5-vit", num_layers=DEPTH, hidden_size=64, ffn_hidden_size=96,
                              num_attention_heads=HEADS, patch_size=14, temporal_patch_size=2,
                              spatial_merge_size=2, window_size=56, fullatt_block_indexes=[1])  # fmt: skip
    return hf, ours, ImageProjectorConfig(norm="RMSNorm", activation="gelu")


def test_qwen25_vit_and_merger_match_hf(megatron_cpu):
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    torch.manual_seed(0)
    hf_cfg, enc_cfg, proj_cfg = qwen_configs()
    hf_cfg._attn_implementation = "sdpa"
    hf = Qwen2_5_VisionTransformerPretrainedModel(hf_cfg).eval()
    with torch.no_grad():  # HF initialises norms to 1 and biases to 0: randomise them so they are tested
        for p in hf.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    encoder, projector = build_vision(enc_cfg, proj_cfg, out_size=48)
    state = qwen_vit_state(hf.state_dict(), HEADS, DEPTH, enc_cfg.padded_ffn_hidden_size)
    load_exact(encoder, state["image_encoder"])
    load_exact(projector, state["image_projector"])
    # windows of 2x2 merge blocks: full windows, edge windows (6x10 patches), a 2-frame video clip
    grid = torch.tensor([[1, 8, 12], [1, 6, 10], [2, 4, 6]])
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 14 * 14)
    with torch.no_grad():
        expected = hf(pixels, grid_thw=grid).pooler_output
        got = projector(encoder(pixels, grid))
    assert got.shape == expected.shape == (int(grid.prod(-1).sum()) // 4, 48)
    assert (got - expected).abs().max() <= 1e-4


def test_qwen25_vit_backward_runs_through_every_window_layer(megatron_cpu):
    _, enc_cfg, proj_cfg = qwen_configs()
    encoder, projector = build_vision(enc_cfg, proj_cfg)
    grid = torch.tensor([[1, 4, 8]])
    projector(encoder(torch.randn(32, 1176), grid)).square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in encoder.parameters())


@pytest.mark.parametrize("size", [(56, 56), (84, 56)], ids=["native", "interpolated"])
def test_siglip_vit_matches_hf(megatron_cpu, size):
    from transformers import SiglipVisionConfig, SiglipVisionModel

    torch.manual_seed(0)
    hf_cfg = SiglipVisionConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=HEADS,
                                image_size=56, patch_size=14, vision_use_head=False)  # fmt: skip
    hf_cfg._attn_implementation = "sdpa"
    hf = SiglipVisionModel(hf_cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    enc_cfg = ImageEncoderConfig(type="siglip", num_layers=2, hidden_size=64, ffn_hidden_size=96,
                                 num_attention_heads=HEADS, patch_size=14, temporal_patch_size=1,
                                 spatial_merge_size=2, image_size=56)  # fmt: skip
    encoder, _ = build_vision(enc_cfg)
    load_exact(encoder, siglip_state(hf.state_dict(), HEADS, 2))
    h, w = size
    images = torch.randn(2, 3, h, w)
    grid = torch.tensor([[1, h // 14, w // 14]] * 2)
    pixels = torch.cat([image_to_patches(img, 14, 2) for img in images])
    with torch.no_grad():
        expected = hf(
            images, interpolate_pos_encoding=size != (56, 56)
        ).last_hidden_state  # [2, hw, D] raster
        got = encoder(pixels, grid)
    rows, cols = patch_coordinates(grid, 2)
    raster = (rows * (w // 14) + cols).view(2, -1)
    for i in range(2):
        ours = got.view(2, -1, 64)[i]
        assert (ours - expected[i, raster[i]]).abs().max() <= 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or not te_installed(), reason="needs CUDA and transformer-engine"
)
@pytest.mark.parametrize("attention", ["sdpa", "backend"])
def test_qwen25_vit_te_backend_matches_hf_on_cuda(attention):
    """The TE layer spec (fused norm + linears; core attention SDPA batched per segment length, or
    TE's THD attention per frame / window) in bf16 against HF in fp32 on the same GPU: relative
    error of the merged features <= 2e-2 (bf16 weights and activations, ~4e-3 per rounding, over
    3 layers); the backward runs to finite gradients."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    with megatron_world(get_accelerator("cuda")):
        torch.manual_seed(0)
        hf_cfg, enc_cfg, proj_cfg = qwen_configs()
        enc_cfg = dataclasses.replace(enc_cfg, attention=attention)
        hf_cfg._attn_implementation = "sdpa"
        hf = Qwen2_5_VisionTransformerPretrainedModel(hf_cfg).eval().cuda()
        with torch.no_grad():
            for p in hf.parameters():
                if p.dim() == 1:
                    p.add_(torch.randn_like(p) * 0.1)
        encoder, projector = build_vision(enc_cfg, proj_cfg, out_size=48, backend="te", dtype=torch.bfloat16)
        encoder, projector = encoder.cuda(), projector.cuda()
        state = qwen_vit_state(hf.state_dict(), HEADS, DEPTH, enc_cfg.padded_ffn_hidden_size)
        load_exact(encoder, te_names(state["image_encoder"]))
        load_exact(projector, state["image_projector"])
        grid = torch.tensor([[1, 8, 12], [1, 6, 10], [2, 4, 6]])
        pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 14 * 14, device="cuda")
        with torch.no_grad():
            expected = hf(pixels, grid_thw=grid.cuda()).pooler_output.float()
            got = projector(encoder(pixels, grid)).float()
        assert ((got - expected).norm() / expected.norm()).item() <= 2e-2
        projector(encoder(pixels, grid)).float().square().mean().backward()
        assert all(torch.isfinite(p.grad).all() for p in encoder.parameters())
