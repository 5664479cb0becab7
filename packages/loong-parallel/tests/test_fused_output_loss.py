"""model.foundation.output_loss=fused: the output layer's loss from loong_kernels' linear +
cross-entropy (no full logits) trains exactly as megatron's logits + vocab-parallel cross-entropy:
the same losses and every parameter's main_grad over optimizer steps of loong_parallel.train_step
with the real lm_forward_step (loss mask, token averaging over micro-batches), for plain and packed
(THD) batches, tied and untied embeddings, with and without fused wgrad accumulation; what it
cannot run with is refused by name."""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import torch

from loong_models import FoundationConfig, ModelConfig, build_model, build_transformer_config
from loong_models.foundation.output_loss import FusedLossGPTModel
from loong_models.precision import PrecisionConfig
from loong_parallel import OptimConfig, ParallelConfig, build_model_chunks, build_optimizer, train_step
from loong_parallel.forward import lm_forward_step
from loong_xpu import get_accelerator

F = FoundationConfig(family="llama", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                     num_query_groups=2, vocab_size=200, max_position_embeddings=64)  # fmt: skip
SEQ, MICRO, STEPS = 24, 2, 3
DOCS = [5, 11, 8]  # the packed batch's documents


def _batches(packed: bool) -> list[dict]:
    """STEPS * MICRO micro-batches of one sequence, about 20% of the tokens masked out."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS * MICRO):
        tokens = torch.randint(0, F.vocab_size, (1, SEQ + 1), generator=g)
        batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
                 "loss_mask": (torch.rand(1, SEQ, generator=g) > 0.2).float()}  # fmt: skip
        if packed:
            batch["position_ids"] = torch.cat([torch.arange(n) for n in DOCS])[None]
            batch["cu_seqlens"] = torch.tensor([0, *torch.tensor(DOCS).cumsum(0).tolist()], dtype=torch.int32)
            batch["max_seqlen"] = max(DOCS)
        else:
            batch["position_ids"] = torch.arange(SEQ)[None]
        out.append(batch)
    return out


def _train(output_loss: str, *, tied: bool, packed: bool, wgrad_fusion: bool = False, fp8_output_layer: bool = False,
           chunk_tokens: int | None = None):  # fmt: skip
    """STEPS fp32 steps on the CPU (local layers): losses, each step's main_grads, final weights."""
    f = dataclasses.replace(F, tie_word_embeddings=tied, output_loss=output_loss, output_loss_chunk_tokens=chunk_tokens)
    if fp8_output_layer:  # the layers' FP8 needs TE on a GPU; the output layer's FP8 loss runs its emulation here
        f = dataclasses.replace(f, precision=PrecisionConfig(fp8="on", fp8_output_layer=True))
    f.validate()
    pcfg = ParallelConfig(wgrad_fusion=wgrad_fusion)
    config = build_transformer_config(f, use_cpu_initialization=True, calculate_per_token_loss=True)

    def provider(pre: bool, post: bool, vp: int | None) -> torch.nn.Module:
        torch.manual_seed(0)
        return build_model(ModelConfig(f, layer_backend="local"), config, device_type="cpu")

    chunks = build_model_chunks(provider, pcfg, config, get_accelerator("cpu"))
    # Adam's eps above the gradients' size: an update proportional to the gradient, so rounding
    # noise in a near-zero gradient element cannot flip a full-size step (lr * sign)
    optimizer, scheduler = build_optimizer(OptimConfig(lr=1e-2, eps=1e-2, warmup_steps=0), pcfg, chunks,
                                           dtype=torch.float32, total_steps=STEPS)  # fmt: skip
    data, losses, grads = _batches(packed), [], []
    step_fn = partial(lm_forward_step, torch.device("cpu"))
    for step in range(STEPS):
        result = train_step(step_fn, iter(data[step * MICRO : (step + 1) * MICRO]), chunks, optimizer, scheduler,
                            num_microbatches=MICRO, seq_length=SEQ, micro_batch_size=1,
                            device=torch.device("cpu"))  # fmt: skip
        losses.append(result.loss)
        grads.append({n: p.main_grad.clone() for n, p in chunks[0].module.named_parameters()})
    model = chunks[0].module
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}, model


@pytest.mark.parametrize("packed", [False, True], ids=["text", "packed-thd"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied-embeddings"])
def test_the_fused_output_loss_trains_exactly_as_megatrons(megatron_cpu, tied, packed):
    base_losses, base_grads, base_weights, base_model = _train("megatron", tied=tied, packed=packed)
    losses, grads, weights, model = _train("fused", tied=tied, packed=packed)
    assert type(model) is FusedLossGPTModel and type(base_model) is not FusedLossGPTModel
    assert losses == pytest.approx(base_losses, rel=1e-5, abs=0)
    _assert_same(grads, base_grads, weights, base_weights)


def test_the_fused_output_loss_with_fused_wgrad_accumulation_trains_as_megatrons(megatron_cpu):
    base_losses, base_grads, base_weights, _ = _train("megatron", tied=True, packed=False, wgrad_fusion=True)
    losses, grads, weights, _ = _train("fused", tied=True, packed=False, wgrad_fusion=True)
    assert losses == pytest.approx(base_losses, rel=1e-5, abs=0)
    _assert_same(grads, base_grads, weights, base_weights)


def test_an_fp8_output_layer_trains_through_the_fp8_loss_near_the_bf16_one(megatron_cpu):
    base_losses, base_grads, _, _ = _train("fused", tied=False, packed=False)
    losses, grads, _, model = _train("fused", tied=False, packed=False, fp8_output_layer=True)
    assert model.fp8_output_layer
    assert losses != base_losses  # the FP8 roundings are in the loss
    assert losses == pytest.approx(base_losses, abs=2e-2)
    for name, value in base_grads[0].items():
        got = grads[0][name]
        assert torch.nn.functional.cosine_similarity(got.flatten(), value.flatten(), dim=0) > 0.99, name


def _assert_same(grads, base_grads, weights, base_weights) -> None:
    for step, (g, base) in enumerate(zip(grads, base_grads, strict=True)):
        assert g.keys() == base.keys()
        for name, value in base.items():
            assert value.abs().max() > 0, name  # every parameter learns (the output weight too)
            torch.testing.assert_close(g[name], value, rtol=1e-5, atol=1e-5, msg=f"step {step}: {name}")
    for name, value in base_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-5, msg=f"weight {name}")


def test_without_labels_the_fused_model_still_returns_logits(megatron_cpu):
    f = dataclasses.replace(F, output_loss="fused")
    config = build_transformer_config(f, use_cpu_initialization=True)
    torch.manual_seed(0)
    model = build_model(ModelConfig(f, layer_backend="local"), config, device_type="cpu")
    tokens = torch.randint(0, F.vocab_size, (2, 8))
    logits = model(tokens, torch.arange(8).expand(2, 8), None)
    assert logits.shape == (2, 8, f.padded_vocab_size(1))
    with torch.no_grad():  # evaluation: the losses of the same logits, no gradients computed
        losses = model(tokens, torch.arange(8).expand(2, 8), None, labels=tokens, loss_mask=torch.ones(2, 8))
    want = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1), reduction="none"
    )
    torch.testing.assert_close(losses, want.view(2, 8), rtol=1e-5, atol=1e-5)


def test_a_loss_not_reduced_by_the_loss_mask_is_refused(megatron_cpu):
    f = dataclasses.replace(F, output_loss="fused")
    config = build_transformer_config(f, use_cpu_initialization=True)
    model = build_model(ModelConfig(f, layer_backend="local"), config, device_type="cpu")
    tokens = torch.randint(0, F.vocab_size, (1, 8))
    losses = model(tokens, torch.arange(8)[None], None, labels=tokens, loss_mask=torch.ones(1, 8))
    with pytest.raises(RuntimeError, match="not proportional to token_weight"):
        (losses * torch.arange(8.0)).sum().backward()


def test_the_fused_model_names_what_it_cannot_run_with():
    from megatron.core.transformer.transformer_config import TransformerConfig

    from loong_models.foundation.output_loss import fused_loss_blockers

    def blocked(**fields) -> list[str]:
        config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, **fields)
        return [what for what, present in fused_loss_blockers(config).items() if present]

    assert blocked() == []
    assert blocked(context_parallel_size=2) == []  # the model computes each rank's tokens (the app refuses CP until tested)
    assert blocked(tensor_model_parallel_size=2) == ["tensor parallelism (vocab-parallel output layer)"]
    assert blocked(tensor_model_parallel_size=2, sequence_parallel=True) == [
        "tensor parallelism (vocab-parallel output layer)",
        "sequence parallelism",
    ]
    assert blocked(mtp_num_layers=1) == ["multi-token prediction (mtp_num_layers)"]


def test_the_fused_loss_with_multi_token_prediction_is_refused_naming_the_key():
    f = dataclasses.replace(F, output_loss="fused", mtp_num_layers=1)
    with pytest.raises(
        ValueError,
        match=r"^model.foundation.output_loss=fused cannot run with "
        r"model.foundation.mtp_num_layers=1",
    ):
        f.validate()


@pytest.mark.parametrize(("fields", "message"), [
    (dict(output_loss_chunk_tokens=64), r"output_loss_chunk_tokens is only read with model.foundation.output_loss=fused"),
    (dict(output_loss="fused", output_loss_chunk_tokens=100), r"output_loss_chunk_tokens=100: expected a multiple of 16"),
])  # fmt: skip
def test_a_bad_chunk_size_of_the_fused_loss_is_refused_naming_the_key(fields, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(F, **fields).validate()


def test_the_chunk_size_reaches_the_fused_loss_and_keeps_its_result(megatron_cpu):
    base_losses, base_grads, _, _ = _train("fused", tied=True, packed=False)
    chunked = dataclasses.replace(F, output_loss="fused", tie_word_embeddings=True, output_loss_chunk_tokens=16)
    config = build_transformer_config(chunked, use_cpu_initialization=True)
    model = build_model(ModelConfig(chunked, layer_backend="local"), config, device_type="cpu")
    assert model.chunk_tokens == 16  # 24-token sequences: two chunks, the last one partial
    losses, grads, _, _ = _train("fused", tied=True, packed=False, chunk_tokens=16)
    assert losses == pytest.approx(base_losses, rel=1e-5, abs=0)
    for name, value in base_grads[-1].items():
        torch.testing.assert_close(grads[-1][name], value, rtol=1e-4, atol=1e-5, msg=name)
