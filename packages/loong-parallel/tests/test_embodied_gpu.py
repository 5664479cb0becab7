"""GPU: the embodied (Pi0.5) kind's step never blocks the host on the device between its
forward and backward, and megatron's precision-aware optimizer (optim.precision_aware,
optim.state_dtype) trains a tiny Pi0.5 in bf16 as the default optimizer does.

Run on a CUDA machine with TE: ``pytest -m gpu packages/loong-parallel/tests/test_embodied_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from loong_models.embodied import Pi05Policy
from loong_models.specs import te_installed
from loong_parallel import OptimConfig, ParallelConfig, build_model_chunks, build_optimizer
from loong_parallel.embodied import EmbodiedPolicy, policy_forward_step
from loong_parallel.step import train_step
from loong_xpu import get_accelerator

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not te_installed(), reason="needs transformer-engine"),
]


def _train(
    tiny, batches, ocfg: OptimConfig, steps: int = 6
) -> tuple[list[float], torch.Tensor, torch.Tensor]:
    kind, pcfg = EmbodiedPolicy(tiny), ParallelConfig(distributed_optimizer=True)
    config = kind.transformer_config(pcfg, dtype=torch.bfloat16, device_type="cuda")
    torch.manual_seed(0)
    chunks = build_model_chunks(
        kind.provider(config, pcfg, device_type="cuda"), pcfg, config, get_accelerator("cuda")
    )
    optimizer, scheduler = build_optimizer(ocfg, pcfg, chunks, dtype=torch.bfloat16, total_steps=steps)
    weight = chunks[0].module.action_out_proj.weight
    initial = weight.detach().float().clone()
    data, device = batches(1), torch.device("cuda")
    losses = [train_step(kind.forward_step(device), data, chunks, optimizer, scheduler, num_microbatches=2,
                         seq_length=1, micro_batch_size=2, device=device).loss for _ in range(steps)]  # fmt: skip
    return losses, initial, weight.detach().float().clone()


def test_precision_aware_adam_trains_as_the_default_optimizer(megatron_cuda, tiny_pi05, pi05_batches):
    common = dict(lr=1e-3, warmup_steps=0, clip_grad=1.0)
    ref, initial, ref_w = _train(tiny_pi05, pi05_batches, OptimConfig(**common))
    fp32, _, fp32_w = _train(tiny_pi05, pi05_batches, OptimConfig(precision_aware=True, **common))
    bf16, _, bf16_w = _train(
        tiny_pi05, pi05_batches, OptimConfig(precision_aware=True, state_dtype="bf16", **common)
    )
    assert not torch.equal(ref_w, initial)  # the default optimizer moved the weights
    # fp32 moments: the same Adam update; only where the bf16 weight is rounded differs
    assert fp32 == pytest.approx(ref, rel=1e-2), (ref, fp32)
    torch.testing.assert_close(fp32_w, ref_w, rtol=2e-2, atol=2e-3)
    # bf16 moments: ~3 significant digits in the moments, the same trajectory over a few steps
    assert bf16 == pytest.approx(ref, rel=3e-2), (ref, bf16)
    torch.testing.assert_close(bf16_w, ref_w, rtol=5e-2, atol=5e-3)


def test_the_policy_step_queues_forward_and_backward_without_a_stream_sync(tiny_pi05, pi05_batches):
    """A sync (a blocking host-device copy, a read-back) would stall the host, which launches the
    kernels of this host-bound model, until the device has drained its queue."""
    policy = Pi05Policy(tiny_pi05).cuda().bfloat16()
    batch = {k: v.pin_memory() for k, v in next(pi05_batches(1)).items()}  # as the data path stages it
    device = torch.device("cuda")
    policy_forward_step(device, iter([batch]), policy)  # warm-up: allocator, kernels, pinned pool
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss_sum, loss_func = policy_forward_step(device, iter([batch]), policy)
        loss, count, _ = loss_func(loss_sum)
        (loss / count).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert (
        policy.action_out_proj.weight.grad is not None and policy.vision.layers[0].fc1.weight.grad is not None
    )
