"""A NaN / Inf loss or gradient skips the update (weights, optimizer and LR schedule untouched)
and the guard stops a run that keeps producing them."""

import pytest
import torch

from loong_models import FoundationConfig, ModelConfig, build_model, build_transformer_config
from loong_parallel import (
    LOSS_KEY,
    NonFiniteError,
    NonFiniteGuard,
    OptimConfig,
    ParallelConfig,
    build_model_chunks,
    build_optimizer,
    train_step,
)
from loong_xpu import get_accelerator

SEQ, VOCAB = 8, 128


def _poisoned_loss(per_token: torch.Tensor, poison: str | None):
    s = per_token.float().sum()
    if poison == "loss":
        s = s * float("nan")
    elif poison == "grad":  # the loss stays finite, d/dx sqrt(x) at 0 is inf, times 0 is NaN
        s = s + 0.0 * torch.sqrt(s - s.detach())
    # "reported": the gradients stay finite and only the loss the step reports is NaN
    n = torch.tensor(float(per_token.numel()))
    reported = s.detach() * float("nan") if poison == "reported" else s.detach()
    return s, n.int(), {LOSS_KEY: torch.stack([reported, n])}


def _forward_step(poison: str | None):
    def forward_step(data_iterator, model):
        tokens = next(data_iterator)
        positions = torch.arange(SEQ).unsqueeze(0)
        out = model(tokens, positions, None, labels=tokens.roll(-1, dims=1))
        return out, lambda per_token: _poisoned_loss(per_token, poison)

    return forward_step


@pytest.fixture(scope="module")
def setup(megatron_cpu):
    f = FoundationConfig(num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=2, vocab_size=VOCAB)
    config = build_transformer_config(f, use_cpu_initialization=True)
    chunks = build_model_chunks(
        lambda pre, post, vp: build_model(ModelConfig(f, layer_backend="local"), config, device_type="cpu"),
        ParallelConfig(), config, get_accelerator("cpu"),
    )  # fmt: skip
    optimizer, scheduler = build_optimizer(OptimConfig(warmup_steps=0), ParallelConfig(), chunks,
                                           dtype=torch.float32, total_steps=10)  # fmt: skip
    return chunks, optimizer, scheduler


def _step(setup, poison: str | None):
    chunks, optimizer, scheduler = setup
    tokens = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(0))
    return train_step(_forward_step(poison), iter([tokens]), chunks, optimizer, scheduler, num_microbatches=1,
                      seq_length=SEQ, micro_batch_size=1, device=torch.device("cpu"))  # fmt: skip


def _weights(chunks) -> list[torch.Tensor]:
    return [p.detach().clone() for c in chunks for p in c.parameters()]


@pytest.mark.parametrize("poison", ["loss", "grad", "reported"])
def test_a_non_finite_step_changes_nothing_and_the_next_one_trains(setup, poison):
    chunks, optimizer, scheduler = setup
    assert not _step(setup, None).skipped
    before, steps_before = _weights(chunks), scheduler.num_steps
    bad = _step(setup, poison)
    assert bad.skipped and bad.nonfinite and (bad.loss != bad.loss) == (poison != "grad")
    # a NaN gradient with a finite loss is caught by the optimizer's own gradient norm (no second
    # pass over the gradients), whose wrappers are gone after the step; the loss is read with that
    # norm, so a NaN loss alone (finite gradients) also leaves the weights alone
    if poison == "grad":
        assert bad.grad_norm is not None and bad.grad_norm != bad.grad_norm
    if poison == "reported":
        assert bad.grad_norm is not None and bad.grad_norm == bad.grad_norm
    assert not [key for key in vars(optimizer) if key.startswith("_loong")]
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(chunks))), "a skipped step changed the weights"
    assert scheduler.num_steps == steps_before, "a skipped step advanced the LR schedule"
    good = _step(setup, None)
    assert not good.skipped and good.grad_norm is not None and torch.isfinite(torch.tensor(good.grad_norm))
    assert all(torch.isfinite(w).all() for w in _weights(chunks))


def test_guard_stops_after_the_limit_in_a_row_and_resets_on_a_good_step(setup):
    guard = NonFiniteGuard(limit=2)
    guard.observe(1, _step(setup, "loss"))
    guard.observe(2, _step(setup, None))  # a finite step resets the count
    guard.observe(3, _step(setup, "grad"))
    with pytest.raises(NonFiniteError, match=r"2 steps in a row \(up to step 4\)"):
        guard.observe(4, _step(setup, "loss"))


@pytest.mark.parametrize("bypassed", ["get_grad_norm", "step_with_ready_grads"])
def test_a_megatron_step_that_bypasses_a_patched_method_fails_naming_the_patch(setup, bypassed):
    """The skip rests on loong_xpu's patches of megatron's ChainedOptimizer: a step that computes
    its norm, or updates, some other way than through them stops with one line naming the patch
    (a norm it cannot see stops it before the update)."""
    chunks, optimizer, _ = setup
    megatrons = getattr(type(optimizer), bypassed).__wrapped__  # what the patch wraps
    setattr(optimizer, bypassed, megatrons.__get__(optimizer))  # called instead of the patched method
    before = _weights(chunks)
    try:
        with pytest.raises(RuntimeError, match=rf"^loong_xpu patch megatron.core.optimizer.optimizer:ChainedOptimizer."
                                               rf"{bypassed}: megatron's ChainedOptimizer.step "):  # fmt: skip
            _step(setup, None)
    finally:
        delattr(optimizer, bypassed)
    if bypassed == "get_grad_norm":
        assert all(torch.equal(a, b) for a, b in zip(before, _weights(chunks)))
    assert not [key for key in vars(optimizer) if key.startswith("_loong")]
