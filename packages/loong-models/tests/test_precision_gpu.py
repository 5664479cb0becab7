"""GPU: adaptive FP8 reaches TE's modules. A tiny Llama built with TE layers and an adaptive
policy: each TE linear reports ``will_execute_quantized`` exactly as the decision table says, and
a forward + backward under the run's FP8 recipe gives finite loss and gradients.

Run on a CUDA machine with transformer-engine: ``pytest -m gpu packages/loong-models/tests/test_precision_gpu.py``.
"""

from __future__ import annotations

import json

import pytest
import torch

from loong_models import FoundationConfig, ModelConfig, build_model, build_transformer_config
from loong_models.precision import PrecisionConfig, decide_modules, load_policy, precision_fields
from loong_models.specs import te_installed
from loong_xpu import get_accelerator

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not te_installed(), reason="needs transformer-engine"),
]
SEQ, BATCH = 128, 2


def policy_file(tmp_path, recipe: str):
    import transformer_engine

    # qkv and fc1 win from 256 tokens (this run's), proj never, fc2 only from 1M tokens
    rules = {"layernorm_column": {"qkv": [{"tp": 1, "min_tokens": 256, "measured_speedup": 1.1}],
                                  "fc1": [{"tp": 1, "min_tokens": 128, "measured_speedup": 1.2}]},
             "row": {"proj": [{"tp": 1, "min_tokens": None, "measured_speedup": 0.9}],
                     "fc2": [{"tp": 1, "min_tokens": 2**20, "measured_speedup": 1.05}]}}  # fmt: skip
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({"gpu_name": torch.cuda.get_device_name(), "te_version": transformer_engine.__version__,
                                "recipe": recipe, "rules": rules}))  # fmt: skip
    return str(path)


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_te_modules_execute_quantized_exactly_as_the_policy_decides(megatron_cuda, tmp_path, recipe):
    if recipe not in get_accelerator("cuda").fp8_recipes():
        pytest.skip(f"this GPU cannot run {recipe}")
    f = FoundationConfig(family="llama", num_layers=2, hidden_size=256, ffn_hidden_size=512, num_attention_heads=4,
                         num_query_groups=2, vocab_size=512, max_position_embeddings=SEQ,
                         precision=PrecisionConfig(fp8="adaptive", recipe=recipe, policy=policy_file(tmp_path, recipe)))  # fmt: skip
    policy = load_policy(f.precision.policy)
    fields = precision_fields(f.precision, policy, gemms=f.gemm_kinds(), tp=1, tokens=SEQ * BATCH, prefix="model.foundation")
    config = build_transformer_config(f, params_dtype=torch.bfloat16, bf16=True, **fields)
    model = build_model(ModelConfig(foundation=f, layer_backend="te"), config, device_type="cuda").cuda()
    te_linears = {n: m for n, m in model.named_modules() if hasattr(m, "will_execute_quantized")}
    decisions = decide_modules(policy, list(te_linears), tp=1, tokens=SEQ * BATCH)
    assert {d.gemm for d in decisions.values() if d is not None} == {"qkv", "proj", "fc1", "fc2"}
    for name, module in te_linears.items():
        wanted = decisions[name] is not None and decisions[name].fp8
        assert module.will_execute_quantized(True) == wanted, name
    tokens = torch.randint(0, 512, (BATCH, SEQ), device="cuda")
    pos = torch.arange(SEQ, device="cuda").expand(BATCH, -1)
    loss = model(tokens, pos, None, labels=tokens).float().mean()
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
