"""PEFT LoRA adapters (made by the peft package) loaded into a Loong model in process: the stacked
import gives PEFT's outputs exactly, also for the common q/v-only adapter; mismatches are refused."""

from __future__ import annotations

import pytest
import torch

from loong_ckpt.testing.hf_models import make_hf_model

TOKENS = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("peft-import") / "hf", "qwen2", vocab=1000)


def _peft(hf, out, targets: list[str]):
    """A peft-made adapter with random A and small random B; returns (dir, its logits, base logits)."""
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=2, lora_alpha=4, target_modules=targets, init_lora_weights=False))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.mul_(0.05)
        model.save_pretrained(out)
        want = model(TOKENS).logits
        with model.disable_adapter():
            base_logits = model(TOKENS).logits
    return out, want, base_logits


def _loong_logits(hf, adapter, rank: int, alpha: float, targets: list[str] | None = None) -> torch.Tensor:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from loong_ckpt.mcore_io import _single_process_megatron
    from loong_ckpt.online import load_hf_weights, read_hf_model
    from loong_ckpt.peft_import import load_peft_adapters
    from loong_models import LoraConfig, ModelConfig, build_model, build_transformer_config

    with _single_process_megatron():
        model_parallel_cuda_manual_seed(0)
        f = read_hf_model(hf)
        lora = LoraConfig(rank=rank, alpha=alpha, **({"targets": targets} if targets else {}))
        cfg = ModelConfig(foundation=f, lora=lora, layer_backend="local")
        tconfig = build_transformer_config(f, use_cpu_initialization=True, params_dtype=torch.float32,
                                           pipeline_dtype=torch.float32)  # fmt: skip
        model = build_model(cfg, tconfig, device_type="cpu")
        load_hf_weights(hf, [model], cfg)
        assert load_peft_adapters(adapter, [model], cfg) == 2 * 2 * len(lora.targets)
        with torch.no_grad():
            return model(TOKENS, torch.arange(TOKENS.shape[1]).expand(2, -1), None)[..., :1000]


ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_a_peft_adapter_on_every_projection_gives_peft_outputs_in_loong(hf, tmp_path):
    adapter, want, base = _peft(hf, tmp_path / "all", ALL)
    assert (want - base).abs().max() > 1e-2
    # Loong rank 6 = 3 stacked Q/K/V parts of rank 2; alpha 6 != 3 x 4: B is rescaled to PEFT's alpha / r
    torch.testing.assert_close(_loong_logits(hf, adapter, rank=6, alpha=6.0), want, atol=1e-5, rtol=1e-5)


def test_peft_default_q_v_adapter_loads_with_zero_k_and_no_mlp_adapters(hf, tmp_path):
    adapter, want, _ = _peft(hf, tmp_path / "qv", ["q_proj", "v_proj"])
    got = _loong_logits(hf, adapter, rank=6, alpha=12.0, targets=["linear_qkv"])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_rank_too_small_and_an_unadapted_projection_are_refused_naming_the_key(hf, tmp_path):
    from loong_ckpt.hf_config import ConversionError

    adapter, _, _ = _peft(hf, tmp_path / "all", ALL)
    with pytest.raises(ConversionError, match=r"model.lora.rank must be >= 6 \(got 4\)"):
        _loong_logits(hf, adapter, rank=4, alpha=8.0)
    with pytest.raises(ConversionError, match=r"PEFT adapts .*mlp.down_proj.*which model.lora.targets does not adapt"):
        _loong_logits(hf, adapter, rank=6, alpha=12.0, targets=["linear_qkv", "linear_proj", "linear_fc1"])
