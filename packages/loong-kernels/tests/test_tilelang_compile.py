"""Every TileLang kernel compiles for sm_90a (Hopper) here, without a GPU (nvcc is enough)."""

import importlib

import pytest

from loong_kernels.tilelang_support import nvcc_available, tilelang_importable

pytestmark = pytest.mark.skipif(
    not (tilelang_importable() and nvcc_available()), reason="needs tilelang and nvcc to compile kernels"
)

SCALE = 576**-0.5
# (module, builder, args): the shapes of DeepSeek-V3.2 (latent 512 + rope 64, top-k 2048,
# indexer 64 heads x 128) and of common dense models, plus a small-head variant.
CASES = [
    ("rms_norm", "build_fwd", (4096, "bfloat16", False, 1e-6)),
    ("rms_norm", "build_fwd", (4096, "bfloat16", True, 1e-6)),
    ("rms_norm", "build_bwd", (4096, "bfloat16", False)),
    ("rms_norm", "build_bwd", (7168, "float16", True)),
    ("swiglu", "build_fwd", (11008, "bfloat16")),
    ("swiglu", "build_bwd", (11008, "bfloat16")),
    ("sparse_mla", "build_fwd", (64, 512, 64, 2048, SCALE, "bfloat16")),
    ("sparse_mla", "build_fwd", (128, 512, 64, 2048, SCALE, "bfloat16")),
    ("sparse_mla", "build_fwd", (16, 512, 64, 128, SCALE, "bfloat16")),
    ("sparse_mla", "build_bwd", (64, 512, 64, 2048, SCALE, "bfloat16")),
    ("sparse_mla", "build_bwd", (16, 512, 64, 128, SCALE, "bfloat16")),
    ("sparse_mla", "build_head_mean_probs", (128, 512, 64, 2048, SCALE, "bfloat16")),
    ("indexer", "build_scores", (64, 128, "bfloat16")),
    ("indexer", "build_topk_logits_fwd", (64, 128, 2048, "bfloat16")),
    ("indexer", "build_topk_logits_bwd", (64, 128, 2048, "bfloat16")),
    ("sparse_mla", "build_head_mean_probs", (16, 512, 64, 128, SCALE, "bfloat16")),
    ("indexer", "build_scores", (16, 32, "bfloat16")),
    ("indexer", "build_topk_logits_fwd", (16, 32, 128, "bfloat16")),
    ("indexer", "build_topk_logits_bwd", (16, 32, 128, "bfloat16")),
    # llama3.2-1b's QKV rows (8 groups of 4 query heads of 64, micro-batch 12: 96 rows a position) and Qwen's 128-wide heads
    ("qkv_rope", "build_fwd", (4, 64, 96, "bfloat16")),
    ("qkv_rope", "build_bwd", (4, 64, 96, "bfloat16")),
    ("qkv_rope", "build_fwd", (7, 128, 4, "float16")),
    ("qkv_rope", "build_bwd", (7, 128, 4, "float16")),
    # llama3's vocab (62 full tiles and a tail) and one smaller than a tile, loss only
    ("linear_cross_entropy", "build_ce", (128256, "bfloat16", True)),
    ("linear_cross_entropy", "build_ce", (1000, "float16", False)),
    # the FP8 loss's casts: llama's vocab (the gradient, E5M2) and a hidden width (E4M3)
    ("linear_cross_entropy_fp8", "build_cast_transpose", (128256, "bfloat16", "float8_e5m2")),
    ("linear_cross_entropy_fp8", "build_cast_transpose", (4096, "bfloat16", "float8_e4m3")),
]


@pytest.mark.parametrize(("module", "builder", "args"), CASES, ids=[f"{m}.{b}{a[:2]}" for m, b, a in CASES])
def test_kernel_compiles_for_sm90a(module, builder, args):
    build = getattr(importlib.import_module(f"loong_kernels.tl.{module}"), builder)
    kernel = build(*args, target="sm_90a")
    source = kernel.get_kernel_source()
    assert "__global__" in source
    # the compiled module exists, i.e. nvcc produced code for the target and not just the CUDA text
    assert kernel.adapter is not None
