"""GPU: the Transformer Engine layer spec (TEGroupedMLP experts, TE's fused norm+linear names,
TE's replicated MLA down projections) loads the converted checkpoint (written with the local
spec's key names, found through the rules' aliases) and the HF directory online, and gives HF's
logits.

Run on a CUDA machine with transformer-engine: ``pytest -m gpu packages/loong-ckpt/tests/test_te_gpu.py``.
Loong runs fp32 with TF32 off; HF's reference logits come from the CPU, so the tolerance (1e-3)
covers CUDA vs CPU fp32 summation order only. Not run here (no GPU on the development host).
"""

from __future__ import annotations

import pytest
import torch

from loong_ckpt.testing import MOE_FAMILIES, get_converted
from loong_ckpt.testing.parity_worker import loong_logits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
TOL = 1e-3


@pytest.fixture(scope="module")
def megatron_cuda():
    from loong_models.specs import te_installed
    from loong_xpu import get_accelerator
    from loong_xpu.testing import megatron_world

    if not te_installed():
        pytest.skip("needs transformer-engine")
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    with megatron_world(get_accelerator("cuda")):
        yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


@pytest.mark.parametrize("family", ("qwen3", *MOE_FAMILIES))
@pytest.mark.parametrize("kind", ["ckpt", "hf-online"])
def test_te_spec_matches_hf(family, kind, tmp_path_factory, megatron_cuda):
    c = get_converted(tmp_path_factory, family)
    tokens = torch.load(c.tokens).cuda()
    logits = loong_logits(c.ckpt if kind == "ckpt" else c.hf, tokens, backend="te")
    diff = (logits.float().cpu() - c.ref).abs().max().item()
    assert diff <= TOL, f"{family} {kind} with the TE spec: max abs diff {diff}"
