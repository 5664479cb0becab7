"""The embodied (Pi0.5) kind's training step: its loss scaling and its optimizer options."""

from __future__ import annotations

import pytest
import torch

from loong_parallel import OptimConfig, ParallelConfig, build_model_chunks, build_optimizer
from loong_parallel.embodied import EmbodiedPolicy
from loong_parallel.step import train_step
from loong_xpu import get_accelerator


def _train(
    tiny, batches, per_token_loss: bool, steps: int = 3
) -> tuple[list[float], dict[str, torch.Tensor], dict]:
    """``steps`` optimizer steps of 2 micro-batches; megatron scales the gradients by the global
    element count (``per_token_loss``) or each micro-batch's loss by its own count (the kind's)."""
    kind, pcfg = EmbodiedPolicy(tiny), ParallelConfig()
    config = kind.transformer_config(pcfg, dtype=torch.float32, device_type="cpu")
    config.calculate_per_token_loss = per_token_loss
    torch.manual_seed(0)
    chunks = build_model_chunks(
        kind.provider(config, pcfg, device_type="cpu"), pcfg, config, get_accelerator("cpu")
    )
    optimizer, scheduler = build_optimizer(OptimConfig(lr=1e-2, warmup_steps=0, clip_grad=0.05), pcfg, chunks,
                                           dtype=torch.float32, total_steps=steps)  # fmt: skip
    data, device = batches(1), torch.device("cpu")
    initial = {k: v.detach().clone() for k, v in chunks[0].module.state_dict().items()}
    losses = [train_step(kind.forward_step(device), data, chunks, optimizer, scheduler, num_microbatches=2,
                         seq_length=1, micro_batch_size=2, device=device).loss for _ in range(steps)]  # fmt: skip
    return losses, {k: v.detach().clone() for k, v in chunks[0].module.state_dict().items()}, initial


def test_scaling_each_micro_batch_loss_trains_as_scaling_the_gradient_buffer(
    megatron_cpu, tiny_pi05, pi05_batches
):
    """The kind's default (no per-token loss: every micro-batch holds the same element count)
    gives the losses and weights of megatron's per-token path, fp32, within rounding (1e-6):
    the 1 / count factor enters before the backward instead of after it."""
    assert EmbodiedPolicy(tiny_pi05).transformer_config(ParallelConfig(), dtype=torch.float32,
                                                   device_type="cpu").calculate_per_token_loss is False  # fmt: skip
    ref_losses, ref_weights, initial = _train(tiny_pi05, pi05_batches, per_token_loss=True)
    losses, weights, _ = _train(tiny_pi05, pi05_batches, per_token_loss=False)
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    assert not torch.allclose(
        weights["action_out_proj.weight"], initial["action_out_proj.weight"]
    )  # it trained
    for name, w in weights.items():
        torch.testing.assert_close(w, ref_weights[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    "ocfg, pcfg, message",
    [
        (OptimConfig(state_dtype="bf16"), ParallelConfig(), r"optim.state_dtype=bf16 needs optim.precision_aware=true"),
        (OptimConfig(precision_aware=True), ParallelConfig(distributed_optimizer=True),
         r"optim.precision_aware=true needs CUDA \(Transformer Engine's FusedAdam\); the device is cpu"),
        (OptimConfig(precision_aware=True), ParallelConfig(),
         r"optim.precision_aware=true needs parallel.distributed_optimizer=true"),
    ],
)  # fmt: skip
def test_precision_aware_optimizer_settings_that_cannot_run_name_the_key(
    megatron_cpu, tiny_pi05, ocfg, pcfg, message
):
    kind = EmbodiedPolicy(tiny_pi05)
    config = kind.transformer_config(pcfg, dtype=torch.float32, device_type="cpu")
    chunks = build_model_chunks(
        kind.provider(config, pcfg, device_type="cpu"), pcfg, config, get_accelerator("cpu")
    )
    with pytest.raises(ValueError, match=message):
        build_optimizer(ocfg, pcfg, chunks, dtype=torch.float32, total_steps=1)
