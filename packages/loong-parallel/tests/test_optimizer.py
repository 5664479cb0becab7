"""The LR schedule and the optimizer are megatron-core's, wired by loong-parallel."""

import torch

from loong_models import FoundationConfig, ModelConfig, build_model, build_transformer_config
from loong_parallel import OptimConfig, ParallelConfig, build_model_chunks, build_optimizer
from loong_xpu import get_accelerator


def test_warmup_then_cosine_to_min_lr(megatron_cpu):
    f = FoundationConfig(num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=2, vocab_size=128)
    config = build_transformer_config(f, use_cpu_initialization=True)
    chunks = build_model_chunks(
        lambda pre, post, vp: build_model(ModelConfig(f, layer_backend="local"), config, device_type="cpu"),
        ParallelConfig(), config, get_accelerator("cpu"),
    )  # fmt: skip
    ocfg = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=4, schedule="cosine")
    optimizer, scheduler = build_optimizer(ocfg, ParallelConfig(), chunks, dtype=torch.float32, total_steps=20)
    lrs = []
    for _ in range(20):
        scheduler.step(increment=1)
        lrs.append(optimizer.param_groups[0]["lr"])
    assert lrs[:4] == [2.5e-4, 5e-4, 7.5e-4, 1e-3]  # linear warmup
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:]))  # then non-increasing
    assert abs(lrs[-1] - 1e-4) < 1e-12  # reaches min_lr at the last step
