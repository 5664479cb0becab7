"""GPU: the embodied (Pi0.5) kind's step never blocks the host on the device between its
forward and backward nor after its optimizer update is queued, megatron's precision-aware
optimizer (optim.precision_aware, optim.state_dtype) trains a tiny Pi0.5 in bf16 as the default
optimizer does, and so do CUDA-graphed compiled layers / policy (model.embodied.compile_mode=
reduce-overhead) and batched gradient accumulation (parallel.grad_accumulation=batched).

Run on a CUDA machine with TE: ``pytest -m gpu packages/loong-parallel/tests/test_embodied_gpu.py``.
"""

from __future__ import annotations

import dataclasses

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
    tiny, batches, ocfg: OptimConfig, steps: int = 6, accumulation: str = "hooks"
) -> tuple[list[float], torch.Tensor, torch.Tensor]:
    kind, pcfg = (
        EmbodiedPolicy(tiny),
        ParallelConfig(distributed_optimizer=True, grad_accumulation=accumulation),
    )
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


def test_once_the_update_is_queued_the_step_reads_nothing_back(megatron_cuda, tiny_pi05, pi05_batches):
    """The loss and the gradient norm are read before megatron queues the optimizer update; a read
    after it would make the host wait for the whole update instead of queueing the next step."""
    kind, pcfg = EmbodiedPolicy(tiny_pi05), ParallelConfig(distributed_optimizer=True)
    config = kind.transformer_config(pcfg, dtype=torch.bfloat16, device_type="cuda")
    chunks = build_model_chunks(
        kind.provider(config, pcfg, device_type="cuda"), pcfg, config, get_accelerator("cuda")
    )
    optimizer, scheduler = build_optimizer(OptimConfig(lr=1e-3, warmup_steps=0, clip_grad=1.0), pcfg, chunks,
                                           dtype=torch.bfloat16, total_steps=4)  # fmt: skip
    data, device = pi05_batches(1), torch.device("cuda")

    def step():
        return train_step(kind.forward_step(device), data, chunks, optimizer, scheduler, num_microbatches=2,
                          seq_length=1, micro_batch_size=2, device=device)  # fmt: skip

    step()  # warm-up: megatron's one-time checks (grad-norm groups) read back once
    update = optimizer.step_with_ready_grads

    def update_then_forbid_syncs() -> bool:
        ok = update()
        torch.cuda.set_sync_debug_mode("error")  # until train_step returns
        return ok

    optimizer.step_with_ready_grads = update_then_forbid_syncs
    try:
        result = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        vars(optimizer).pop("step_with_ready_grads", None)
    assert not result.skipped and isinstance(result.grad_norm, float) and result.grad_norm > 0


@pytest.mark.parametrize("scope", ["per_layer", "policy"])
def test_cuda_graphed_compiled_policy_trains_as_the_eager_one(megatron_cuda, tiny_pi05, pi05_batches, scope):
    """compile_mode=reduce-overhead replays each compiled graph as a CUDA graph; its gradients still
    reach megatron's gradient buffer through the DDP hooks and the optimizer moves the weights."""
    common = OptimConfig(lr=1e-3, warmup_steps=0, clip_grad=1.0)
    eager, initial, eager_w = _train(tiny_pi05, pi05_batches, common)
    graphed_cfg = dataclasses.replace(tiny_pi05, compile_scope=scope, compile_mode="reduce-overhead")
    graphed, _, graphed_w = _train(graphed_cfg, pi05_batches, common)
    assert not torch.equal(graphed_w, initial)
    assert graphed == pytest.approx(eager, rel=3e-2), (eager, graphed)
    torch.testing.assert_close(graphed_w, eager_w, rtol=5e-2, atol=5e-3)


def test_batched_gradient_accumulation_trains_bit_for_bit_as_megatrons_hooks(
    megatron_cuda, tiny_pi05, pi05_batches
):
    """parallel.grad_accumulation=batched: the same fp32 adds into main_grad in the same order,
    one multi-tensor add per micro-batch instead of a Python hook and an add per parameter."""
    common = OptimConfig(lr=1e-3, warmup_steps=0, clip_grad=1.0)
    hooks, _, hooks_w = _train(tiny_pi05, pi05_batches, common)
    batched, _, batched_w = _train(tiny_pi05, pi05_batches, common, accumulation="batched")
    assert batched == hooks
    assert torch.equal(batched_w, hooks_w)
