"""parallel.wgrad_fusion: the weight-gradient GEMMs accumulate straight into megatron's fp32
main_grad, TE's linears through TE, megatron's own linears (the output layer; every linear of the
local backend) through loong_xpu's GEMMs in place of apex's. Training with it equals training
without it; a model with nothing to fuse is refused by name; auto is on only where TE runs."""

from __future__ import annotations

import pytest
import torch

from loong_models import FoundationConfig, ModelConfig, build_model, build_transformer_config, fusion_fields
from loong_models.specs import te_installed
from loong_parallel import (
    LOSS_KEY,
    OptimConfig,
    ParallelConfig,
    build_model_chunks,
    build_optimizer,
    runtime_transformer_fields,
    train_step,
)
from loong_parallel.model import fuse_wgrad_accumulation, wgrad_fusion_on
from loong_xpu import get_accelerator
from loong_xpu.testing import megatron_world

F = FoundationConfig(family="llama", num_layers=2, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4,
                     num_query_groups=2, vocab_size=256, max_position_embeddings=64)  # fmt: skip
SEQ, MICRO, STEPS = 16, 2, 3


def _forward_step(data_iterator, model):
    tokens = next(data_iterator)
    positions = torch.arange(SEQ).expand(tokens.shape[0], -1)

    def loss(per_token: torch.Tensor):
        s, n = per_token.float().sum(), torch.tensor(per_token.numel())
        return s, n, {LOSS_KEY: torch.stack([s.detach(), n.float()])}

    return model(tokens, positions, None, labels=tokens.roll(-1, dims=1)), loss


def _train_on_cpu(fusion: bool, tied: bool):
    """3 fp32 steps of 2 micro-batches (local layers): the losses, every step's main_grads, the
    weights, and the parameters whose wgrad went straight into main_grad."""
    f = FoundationConfig(**{**vars(F), "tie_word_embeddings": tied})
    pcfg = ParallelConfig(wgrad_fusion=fusion)
    config = build_transformer_config(f, use_cpu_initialization=True)

    def provider(pre: bool, post: bool, vp: int | None) -> torch.nn.Module:
        torch.manual_seed(0)
        return build_model(ModelConfig(f, layer_backend="local"), config, device_type="cpu")

    chunks = build_model_chunks(provider, pcfg, config, get_accelerator("cpu"))
    optimizer, scheduler = build_optimizer(OptimConfig(lr=1e-2, warmup_steps=0), pcfg, chunks,
                                           dtype=torch.float32, total_steps=STEPS)  # fmt: skip
    data = torch.randint(0, 256, (STEPS * MICRO, 1, SEQ), generator=torch.Generator().manual_seed(1))
    losses, grads = [], []
    for step in range(STEPS):
        result = train_step(_forward_step, iter(data[step * MICRO : (step + 1) * MICRO]), chunks, optimizer,
                            scheduler, num_microbatches=MICRO, seq_length=SEQ, micro_batch_size=1,
                            device=torch.device("cpu"))  # fmt: skip
        losses.append(result.loss)
        grads.append({n: p.main_grad.clone() for n, p in chunks[0].module.named_parameters()})
    named = list(chunks[0].module.named_parameters())
    fused = {n for n, p in named if p.grad_added_to_main_grad}
    return losses, grads, {n: p.detach().clone() for n, p in named}, fused


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied-embeddings"])
def test_training_with_fused_wgrad_accumulation_equals_training_without_it(megatron_cpu, tied):
    """Every local linear (the output layer too) accumulates through loong_xpu's GEMM; the
    embedding (with tied weights: the output layer's weight too) keeps DDP's add for its own grad."""
    base_losses, base_grads, base_weights, unfused = _train_on_cpu(False, tied)
    losses, grads, weights, fused = _train_on_cpu(True, tied)
    linears = {n for n in base_weights if n.endswith("weight") and ("linear_" in n or "output_layer" in n)}
    linears -= {n for n in linears if "layer_norm" in n}
    assert not unfused and fused == linears | ({"embedding.word_embeddings.weight"} if tied else set())
    assert losses == pytest.approx(base_losses, rel=1e-6, abs=0)
    for step, (g, base) in enumerate(zip(grads, base_grads)):
        assert g.keys() == base.keys()
        for name, value in base.items():
            torch.testing.assert_close(g[name], value, rtol=1e-6, atol=1e-6, msg=f"step {step}: {name}")
    for name, value in base_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-6, atol=1e-6, msg=f"weight {name}")


def test_fusion_switches_every_megatron_linear_of_the_local_backend(megatron_cpu):
    config = build_transformer_config(F, use_cpu_initialization=True)
    model = build_model(ModelConfig(foundation=F, layer_backend="local"), config, device_type="cpu")
    assert fuse_wgrad_accumulation(model) == 2 * 4 + 1  # qkv, proj, fc1, fc2 per layer, and the output layer
    flags = [
        m.gradient_accumulation_fusion for m in model.modules() if hasattr(m, "gradient_accumulation_fusion")
    ]
    assert len(flags) == 9 and all(flags)


def test_wgrad_fusion_on_a_model_without_linears_is_refused_naming_the_key():
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())  # pi05 / Wan: plain torch layers
    with pytest.raises(ValueError, match=r"^parallel.wgrad_fusion=true but the model has no megatron or TE"):
        fuse_wgrad_accumulation(plain)
    assert fuse_wgrad_accumulation(plain, required=False) == 0  # auto: nothing to fuse, nothing to refuse


def test_auto_fuses_only_where_transformer_engine_runs():
    cpu = get_accelerator("cpu")
    assert wgrad_fusion_on(ParallelConfig(wgrad_fusion=None), cpu) is False
    assert wgrad_fusion_on(ParallelConfig(wgrad_fusion=True), cpu) is True  # the torch GEMM path
    assert wgrad_fusion_on(ParallelConfig(), cpu) is False


def _main_grads_on_cuda(fusion: bool, accel) -> dict[str, torch.Tensor]:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    pcfg = ParallelConfig(wgrad_fusion=fusion)
    config = build_transformer_config(F, **runtime_transformer_fields(pcfg, dtype=torch.bfloat16, device_type="cuda"),
                                      **fusion_fields("te"))  # fmt: skip

    def provider(pre: bool, post: bool, vp: int | None) -> torch.nn.Module:
        torch.manual_seed(0)
        model_parallel_cuda_manual_seed(0, force_reset_rng=True)
        return build_model(ModelConfig(foundation=F, layer_backend="te"), config, device_type="cuda")

    (chunk,) = build_model_chunks(provider, pcfg, config, accel)
    tokens = torch.randint(0, 256, (2, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    pos = torch.arange(64, device="cuda").expand(2, -1)
    for _ in range(2):  # two micro-batches accumulate
        chunk(tokens, pos, None, labels=tokens).float().sum().backward()
    return {n: p.main_grad.clone() for n, p in chunk.module.named_parameters()}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not te_installed(), reason="needs CUDA and TE")
def test_fused_wgrad_accumulation_on_te_layers_gives_the_unfused_gradients():
    """TE's linears and megatron's output layer (TE's GEMM through loong_xpu) on bf16: every
    main_grad equals the unfused one up to the bf16 rounding of the unfused weight gradient."""
    accel = get_accelerator("cuda")
    assert wgrad_fusion_on(ParallelConfig(wgrad_fusion=None), accel)  # auto: on where TE runs
    with megatron_world(accel):
        unfused, fused = _main_grads_on_cuda(False, accel), _main_grads_on_cuda(True, accel)
    assert unfused.keys() == fused.keys() and "output_layer.weight" in fused
    for name, g in unfused.items():
        err = (fused[name] - g).norm() / g.norm()
        assert err < 1e-2, (name, err.item())
