"""The LR schedule and the optimizer are megatron-core's, wired by loong-parallel."""

import pytest
import torch

from loong_models import FoundationConfig, ModelConfig, build_model, build_transformer_config
from loong_parallel import OptimConfig, ParallelConfig, build_model_chunks, build_optimizer
from loong_xpu import get_accelerator


def _chunks():
    f = FoundationConfig(num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=2, vocab_size=128)
    config = build_transformer_config(f, use_cpu_initialization=True)
    return build_model_chunks(
        lambda pre, post, vp: build_model(ModelConfig(f, layer_backend="local"), config, device_type="cpu"),
        ParallelConfig(), config, get_accelerator("cpu"),
    )  # fmt: skip


def test_each_step_runs_at_its_own_rate_warmup_then_cosine_to_min_lr(megatron_cpu):
    ocfg = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=4, schedule="cosine")
    chunks = _chunks()
    optimizer, scheduler = build_optimizer(ocfg, ParallelConfig(), chunks, dtype=torch.float32, total_steps=20)
    lrs = []  # the rate step s runs at: what the optimizer holds before its update
    for _ in range(20):
        lrs.append(optimizer.param_groups[0]["lr"])
        scheduler.step(increment=1)
    assert lrs[:4] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])  # linear warmup; step 1 is not wasted at 0
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:])) and lrs[4] < 1e-3  # then decreasing
    assert lrs[-1] == pytest.approx(1e-4)  # the last step runs at min_lr

    # resuming from the scheduler's state continues the same schedule
    _, resumed = build_optimizer(ocfg, ParallelConfig(), chunks, dtype=torch.float32, total_steps=20)
    state = build_optimizer(ocfg, ParallelConfig(), chunks, dtype=torch.float32, total_steps=20)[1]
    state.step(increment=7)
    resumed.load_state_dict(state.state_dict())
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(lrs[7])


@pytest.mark.parametrize("warmup, total", [(0, 5), (0, 1), (1, 1), (3, 2), (10, 100)])
def test_schedule_never_starts_at_zero_and_ends_at_min_lr(megatron_cpu, warmup, total):
    ocfg = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=warmup, schedule="linear")
    optimizer, scheduler = build_optimizer(ocfg, ParallelConfig(), _chunks(), dtype=torch.float32, total_steps=total)
    lrs = []
    for _ in range(total):
        lrs.append(optimizer.param_groups[0]["lr"])
        scheduler.step(increment=1)
    assert min(lrs) > 0 and max(lrs) == pytest.approx(1e-3)
    if total > 1:
        assert lrs[-1] == pytest.approx(1e-4)
