"""model.foundation.output_loss=fused on a GPU, bf16, TE layers: one train_step of the real
lm_forward_step (2 micro-batches, masked tokens) gives megatron's loss and every parameter's
main_grad up to bf16 rounding, with the TileLang kernel and with the chunked torch reference; with
``precision.fp8_output_layer`` (FP8 GEMMs in the output layer) the same up to FP8 rounding."""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import torch

from loong_kernels import use_implementation
from loong_kernels.tilelang_support import tilelang_importable
from loong_models import FoundationConfig, ModelConfig, build_model, build_transformer_config, fusion_fields
from loong_models.precision import PrecisionConfig
from loong_models.specs import te_installed
from loong_parallel import (
    OptimConfig,
    ParallelConfig,
    build_model_chunks,
    build_optimizer,
    runtime_transformer_fields,
    train_step,
)
from loong_parallel.forward import lm_forward_step
from loong_xpu import get_accelerator
from loong_xpu.testing import megatron_world

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or not te_installed(), reason="needs CUDA and TE"),
]

# a vocabulary of Llama-3's order of magnitude in a small model: the output layer dominates
F = FoundationConfig(family="llama", num_layers=2, hidden_size=512, ffn_hidden_size=1024, num_attention_heads=8,
                     num_query_groups=4, vocab_size=32000, max_position_embeddings=1024)  # fmt: skip
SEQ, MICRO = 512, 2


def _batches() -> list[dict]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(MICRO):
        tokens = torch.randint(0, F.vocab_size, (2, SEQ + 1), generator=g)
        out.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "position_ids": torch.arange(SEQ).expand(2, -1),
                    "loss_mask": (torch.rand(2, SEQ, generator=g) > 0.2).float()})  # fmt: skip
    return out


def _one_step(output_loss: str, tied: bool, accel, fp8_output_layer: bool = False) -> tuple[float, dict[str, torch.Tensor]]:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    f = dataclasses.replace(F, tie_word_embeddings=tied, output_loss=output_loss)
    if fp8_output_layer:  # the output layer alone in FP8: the layers stay BF16 (no FP8 fields below)
        f = dataclasses.replace(f, precision=PrecisionConfig(fp8="on", fp8_output_layer=True))
    pcfg = ParallelConfig()
    config = build_transformer_config(f, **runtime_transformer_fields(pcfg, dtype=torch.bfloat16, device_type="cuda"),
                                      **fusion_fields("te"))  # fmt: skip

    def provider(pre: bool, post: bool, vp: int | None) -> torch.nn.Module:
        torch.manual_seed(0)
        model_parallel_cuda_manual_seed(0, force_reset_rng=True)
        return build_model(ModelConfig(foundation=f, layer_backend="te"), config, device_type="cuda")

    chunks = build_model_chunks(provider, pcfg, config, accel)
    optimizer, scheduler = build_optimizer(OptimConfig(lr=1e-3, warmup_steps=0), pcfg, chunks,
                                           dtype=torch.bfloat16, total_steps=1)  # fmt: skip
    device = torch.device("cuda")
    result = train_step(partial(lm_forward_step, device), iter(_batches()), chunks, optimizer, scheduler,
                        num_microbatches=MICRO, seq_length=SEQ, micro_batch_size=2, device=device)  # fmt: skip
    return result.loss, {n: p.main_grad.float().clone() for n, p in chunks[0].module.named_parameters()}


@pytest.mark.parametrize("impl", ["tilelang", "reference"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied-embeddings"])
def test_the_fused_output_loss_gives_megatrons_loss_and_gradients_on_the_gpu(impl, tied):
    if impl == "tilelang" and not tilelang_importable():
        pytest.skip("tilelang does not import")
    accel = get_accelerator("cuda")
    with megatron_world(accel):
        base_loss, base = _one_step("megatron", tied, accel)
        with use_implementation(impl):
            loss, grads = _one_step("fused", tied, accel)
    print(f"\n{impl} tied={tied}: loss {loss:.6f} vs megatron {base_loss:.6f}")
    assert loss == pytest.approx(base_loss, rel=2e-3)
    assert grads.keys() == base.keys()
    for name, g in base.items():
        err = ((grads[name] - g).norm() / g.norm()).item()
        print(f"  {name}: relative error {err:.2e}")
        assert err < 2e-2, (name, err)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied-embeddings"])
def test_an_fp8_output_layer_gives_megatrons_loss_and_gradients_up_to_fp8_rounding(tied):
    if not tilelang_importable() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs tilelang and FP8 tensor cores")
    accel = get_accelerator("cuda")
    with megatron_world(accel):
        base_loss, base = _one_step("megatron", tied, accel)
        with use_implementation("tilelang"):
            loss, grads = _one_step("fused", tied, accel, fp8_output_layer=True)
    print(f"\nfp8 output layer tied={tied}: loss {loss:.6f} vs megatron {base_loss:.6f}")
    assert loss == pytest.approx(base_loss, rel=1e-2)
    for name, g in base.items():
        cos = torch.nn.functional.cosine_similarity(grads[name].flatten(), g.flatten(), dim=0).item()
        print(f"  {name}: cosine {cos:.5f}")
        assert cos > 0.98, (name, cos)
