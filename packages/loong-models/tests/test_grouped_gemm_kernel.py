"""``model.grouped_gemm_kernel``: TE's kernel for the MoE experts' grouped GEMMs.

CPU: the key is validated (MoE only, a known kernel) and selects TE's switch when the model is
built with TE layers; the cuBLASLt path's pre-hook hands TE the split sizes as a tensor. GPU
(Hopper, TE): the CUTLASS grouped kernel and TE's cuBLASLt grouped GEMM really run (their kernels
are in the profile, with fewer launches than the per-expert cuBLAS GEMMs; cuBLASLt's fewer than
CUTLASS's, its weight gradients grouped too) and give the loss and gradients of the per-expert
cuBLAS GEMMs, on the same tiny Qwen3-MoE model and tokens.
"""

from __future__ import annotations

import os

import pytest
import torch

from loong_models import FoundationConfig, ModelConfig, build_model, build_transformer_config
from loong_models.foundation import MoEConfig
from loong_models.grouped_gemm import splits_on_device, use_cublaslt_grouped_gemms
from loong_models.specs import GROUPED_GEMM_ENV, fusion_fields, select_grouped_gemm_kernel, te_installed

SEQ, BATCH, VOCAB = 128, 2, 512


def moe_foundation() -> FoundationConfig:
    # hidden 256 and expert width 128: every forward and data-gradient GEMM has K % 128 == 0, the
    # CUTLASS kernel's condition
    return FoundationConfig(family="qwen3-moe", num_layers=2, hidden_size=256, num_attention_heads=4,
                            num_query_groups=2, vocab_size=VOCAB, max_position_embeddings=SEQ,
                            moe=MoEConfig(num_experts=8, router_topk=2, ffn_hidden_size=128))  # fmt: skip


def test_a_grouped_gemm_kernel_without_experts_is_refused_naming_the_key():
    cfg = ModelConfig(foundation=FoundationConfig(family="qwen3", num_layers=2), grouped_gemm_kernel="cutlass")
    with pytest.raises(ValueError, match=r"model.grouped_gemm_kernel=cutlass needs an MoE foundation"):
        cfg.validate()


def test_an_unknown_kernel_is_refused():
    with pytest.raises(ValueError, match="'fast' is not a valid GroupedGemmKernel"):
        select_grouped_gemm_kernel("fast")


@pytest.mark.parametrize("choice, env", [("cutlass", "1"), ("cublas", "0")])
def test_the_kernel_choice_sets_tes_switch_and_auto_leaves_it(monkeypatch, choice, env):
    monkeypatch.setenv(GROUPED_GEMM_ENV, "as set by the user")
    select_grouped_gemm_kernel("auto")
    assert os.environ[GROUPED_GEMM_ENV] == "as set by the user"
    select_grouped_gemm_kernel(choice)
    assert os.environ[GROUPED_GEMM_ENV] == env


def test_local_layers_leave_tes_switch_alone(monkeypatch, megatron_cpu):
    monkeypatch.setenv(GROUPED_GEMM_ENV, "as set by the user")  # setenv: restored after the test
    f = moe_foundation()
    config = build_transformer_config(f, use_cpu_initialization=True, **fusion_fields("local"))
    build_model(ModelConfig(foundation=f, layer_backend="local", grouped_gemm_kernel="cutlass"), config,
                device_type="cpu")  # fmt: skip
    assert os.environ[GROUPED_GEMM_ENV] == "as set by the user"


class SplitRecorder(torch.nn.Module):
    """Stands in for a grouped linear's call convention, ``forward(x, m_splits)``."""

    def forward(self, x, m_splits):
        self.seen = m_splits
        return x


def test_the_cublaslt_hook_hands_the_split_sizes_over_as_an_int64_tensor():
    linear = SplitRecorder()
    linear.register_forward_pre_hook(splits_on_device)
    x = torch.zeros(7, 4)
    linear(x, [3, 0, 4])
    assert linear.seen.dtype == torch.int64 and linear.seen.device == x.device
    assert linear.seen.tolist() == [3, 0, 4]
    given = torch.tensor([5, 2])
    linear(x, given)
    assert linear.seen is given  # a tensor already: passed on as it is


def _tiny_te_moe_model(f: FoundationConfig) -> tuple[torch.nn.Module, torch.Tensor]:
    """The GPU tests' bf16 TE model of ``f`` (built with per-expert cuBLAS) and its tokens."""
    config = build_transformer_config(f, params_dtype=torch.bfloat16, bf16=True, **fusion_fields("te"))
    model = build_model(ModelConfig(foundation=f, layer_backend="te", grouped_gemm_kernel="cublas"), config,
                        device_type="cuda").cuda()  # fmt: skip
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    return model, tokens


def _assert_matches_cublas(loss, grads, loss_cublas, grads_cublas) -> None:
    torch.testing.assert_close(loss, loss_cublas, rtol=0, atol=2e-3)
    assert grads.keys() == grads_cublas.keys()
    for name, g in grads_cublas.items():  # bf16 GEMMs accumulated in another order: relative to the gradient's size
        err = (grads[name] - g).abs().max().item()
        assert err <= 2e-2 * g.abs().max().item() + 1e-6, (name, err, g.abs().max().item())


def _loss_and_grads(model, tokens, kernel: str) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[str]]:
    select_grouped_gemm_kernel(kernel)
    model.zero_grad(set_to_none=True)
    pos = torch.arange(SEQ, device="cuda").expand(BATCH, -1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        loss = model(tokens, pos, None, labels=tokens).float().mean()
        loss.backward()
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, kernels


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(not te_installed(), reason="needs transformer-engine")
def test_cutlass_grouped_gemms_run_and_match_cublas(monkeypatch, megatron_cuda):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("TE's CUTLASS grouped GEMM runs on Hopper only")
    # setenv, not delenv: monkeypatch restores only what it changed, and the switch set below
    # would otherwise stay on for every later test of this process
    monkeypatch.setenv(GROUPED_GEMM_ENV, "0")
    f = moe_foundation()
    model, tokens = _tiny_te_moe_model(f)
    loss_cublas, grads_cublas, kernels_cublas = _loss_and_grads(model, tokens, "cublas")
    loss_cutlass, grads_cutlass, kernels_cutlass = _loss_and_grads(model, tokens, "cutlass")

    only_cutlass = set(kernels_cutlass) - set(kernels_cublas)
    assert any("cutlass" in k.lower() for k in only_cutlass), sorted(only_cutlass)[:20]
    assert len(kernels_cutlass) < len(kernels_cublas)  # one launch per grouped GEMM, not one per expert
    assert torch.isfinite(loss_cutlass)
    experts = [n for n in grads_cublas if "experts" in n]
    assert experts, list(grads_cublas)
    _assert_matches_cublas(loss_cutlass, grads_cutlass, loss_cublas, grads_cublas)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(not te_installed(), reason="needs transformer-engine")
def test_cublaslt_grouped_gemms_run_and_match_cublas(monkeypatch, megatron_cuda):
    from loong_models.grouped_gemm import cublaslt_grouped_gemm_supported

    ok, found = cublaslt_grouped_gemm_supported(torch.bfloat16)
    if not ok:
        pytest.skip(f"TE's cuBLASLt grouped GEMM does not run here ({found})")
    monkeypatch.setenv(GROUPED_GEMM_ENV, "0")
    f = moe_foundation()
    model, tokens = _tiny_te_moe_model(f)
    loss_cublas, grads_cublas, kernels_cublas = _loss_and_grads(model, tokens, "cublas")
    _, _, kernels_cutlass = _loss_and_grads(model, tokens, "cutlass")
    handles = use_cublaslt_grouped_gemms(model, torch.bfloat16)
    assert len(handles) == 2 * f.num_layers  # fc1 and fc2 of every MoE layer
    loss_lt, grads_lt, kernels_lt = _loss_and_grads(model, tokens, "cublaslt")

    only_lt = sorted(set(kernels_lt) - set(kernels_cublas) - set(kernels_cutlass))
    assert only_lt, "no kernel of the cuBLASLt grouped path ran"
    # weight gradients grouped too: fewer launches than CUTLASS, which groups only forward and dgrad
    # (and runs on Hopper only: elsewhere it is cuBLAS again)
    assert len(kernels_lt) < min(len(kernels_cutlass), len(kernels_cublas)), (len(kernels_lt), only_lt[:20])
    _assert_matches_cublas(loss_lt, grads_lt, loss_cublas, grads_cublas)
