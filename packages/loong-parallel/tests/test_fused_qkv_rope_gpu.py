"""GPU: ``model.fused_qkv_rope`` (megatron's fused_single_qkv_rope, TE's one-kernel RoPE on the
fused QKV output) gives a Llama the loss and gradients of the split path (RoPE on Q and K after
the split, their gradients concatenated after).

Run on a CUDA machine with TE: ``pytest -m gpu packages/loong-parallel/tests/test_fused_qkv_rope_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from loong_models import load_model_config
from loong_models.specs import te_installed
from loong_parallel import LanguageModel, ParallelConfig, build_model_chunks
from loong_xpu import get_accelerator

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not te_installed(), reason="needs transformer-engine"),
]

SEQ, BATCH = 128, 2


def _run(fused: bool, weights: dict | None, dtype: torch.dtype = torch.float32):
    # llama3.2-1b's attention (GQA 32/8, head dim 64, llama3 RoPE scaling) on a narrow, shallow model
    cfg = load_model_config("llama3.2-1b", ["foundation.num_layers=2", "foundation.hidden_size=256",
                                            "foundation.ffn_hidden_size=512", "foundation.num_attention_heads=4",
                                            "foundation.num_query_groups=2", "foundation.vocab_size=512",
                                            f"+fused_qkv_rope={str(fused).lower()}"])  # fmt: skip
    kind, pcfg = LanguageModel.from_config(cfg, "cuda"), ParallelConfig()
    config = kind.transformer_config(pcfg, dtype=dtype, device_type="cuda")
    assert config.fused_single_qkv_rope is fused and config.apply_rope_fusion
    torch.manual_seed(0)
    (chunk,) = build_model_chunks(kind.provider(config, pcfg, device_type="cuda"), pcfg, config,
                                  get_accelerator("cuda"))  # fmt: skip
    if weights is not None:
        chunk.load_state_dict(weights)
    tokens = torch.randint(0, 512, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    batch = dict(tokens=tokens, labels=tokens.roll(-1, dims=1), loss_mask=torch.ones(BATCH, SEQ),
                 position_ids=torch.arange(SEQ).expand(BATCH, SEQ))  # fmt: skip
    out, loss_func = kind.forward_step(torch.device("cuda"))(iter([batch]), chunk)
    loss, count, _ = loss_func(out)
    (loss / count).backward()
    grads = {n: p.main_grad.float().clone() for n, p in chunk.module.named_parameters()}
    return chunk.state_dict(), (loss / count).detach(), grads


def test_fused_qkv_rope_gives_the_loss_and_gradients_of_the_split_rope(megatron_cuda):
    weights, split_loss, split = _run(False, None)
    _, fused_loss, fused = _run(True, weights)
    torch.testing.assert_close(fused_loss, split_loss, rtol=1e-5, atol=1e-6)
    assert fused.keys() == split.keys()
    for name, grad in split.items():  # the same fp32 GEMMs; RoPE in one kernel instead of two
        diff = (fused[name] - grad).abs().max() / grad.abs().max().clamp_min(1e-12)
        assert diff < 1e-4, f"{name}: gradient differs by {diff:.2e} of its largest entry"
    assert any("linear_qkv" in n and g.abs().sum() > 0 for n, g in fused.items())


def test_in_bf16_the_fused_qkv_rope_runs_loong_kernels_tilelang_kernel_with_the_split_ropes_results(megatron_cuda):
    # in bf16 loong_xpu's manifest sends megatron's fused-QKV RoPE call to loong_kernels.qkv_rope
    pytest.importorskip("tilelang")
    from loong_kernels.ops.qkv_rope import qkv_rope_uses_tilelang

    assert qkv_rope_uses_tilelang(torch.zeros(SEQ, BATCH, 2, 6 * 64, device="cuda", dtype=torch.bfloat16), 4)
    weights, split_loss, split = _run(False, None, torch.bfloat16)
    _, fused_loss, fused = _run(True, weights, torch.bfloat16)
    torch.testing.assert_close(fused_loss, split_loss, rtol=2e-3, atol=1e-3)
    for name, grad in split.items():  # bf16 GEMMs on inputs that may differ by one rounding
        diff = (fused[name] - grad).abs().max() / grad.abs().max().clamp_min(1e-12)
        assert diff < 3e-2, f"{name}: gradient differs by {diff:.2e} of its largest entry"
