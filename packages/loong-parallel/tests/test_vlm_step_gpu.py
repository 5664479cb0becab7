"""GPU: a packed VLM micro-batch's forward step (ViT window and full attention, patch merger,
embedding scatter, multimodal RoPE, TE layers, the loss) and its backward queue their kernels
without a stream sync. A sync (a read-back such as ``.item()`` or ``nonzero`` of a device tensor,
a blocking copy) stops the host, which launches this host-bound step's kernels, until the device
has drained its queue.

Run on a CUDA machine with TE: ``pytest -m gpu packages/loong-parallel/tests/test_vlm_step_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from loong_models import load_model_config
from loong_models.specs import te_installed
from loong_models.testing import packed_batch
from loong_parallel import LanguageModel, ParallelConfig, build_model_chunks
from loong_xpu import get_accelerator

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not te_installed(), reason="needs transformer-engine"),
]


def step_batch() -> dict:
    """:func:`packed_batch` as the multimodal data path hands it to the forward step: host
    tensors in page-locked memory, segment boundaries on the host."""
    b = packed_batch()
    tokens = b["input_ids"]
    params = b["packed_seq_params"]
    batch = dict(tokens=tokens, labels=b["labels"], loss_mask=torch.ones(tokens.shape),
                 position_ids=torch.arange(tokens.shape[1])[None], cu_seqlens=params.cu_seqlens_q,
                 pixel_values=b["pixel_values"], image_grid_thw=b["image_grid_thw"],
                 pixel_values_videos=b["pixel_values_videos"], video_grid_thw=b["video_grid_thw"])  # fmt: skip
    batch = {k: v.pin_memory() for k, v in batch.items()}
    batch["max_seqlen"] = params.max_seqlen_q
    return batch


def test_the_vlm_step_queues_forward_and_backward_without_a_stream_sync(megatron_cuda):
    cfg = load_model_config("tiny-vlm", ["foundation.num_layers=2"])
    kind, pcfg = LanguageModel.from_config(cfg, "cuda"), ParallelConfig()
    assert kind.backend == "te"
    config = kind.transformer_config(pcfg, dtype=torch.bfloat16, device_type="cuda")
    torch.manual_seed(0)
    (chunk,) = build_model_chunks(kind.provider(config, pcfg, device_type="cuda"), pcfg, config,
                                  get_accelerator("cuda"))  # fmt: skip
    step, batch = kind.forward_step(torch.device("cuda")), step_batch()

    def forward_backward() -> None:
        out, loss_func = step(iter([batch]), chunk)
        loss, count, _ = loss_func(out)
        (loss / count).backward()

    forward_backward()  # warm-up: allocator, kernels, TE's workspaces, the pinned pool
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        forward_backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    encoder = chunk.module.image_encoder
    assert encoder.patch_embed.proj.weight.main_grad.abs().sum() > 0  # the ViT's backward ran


def _chunk(fused_mlp: bool):
    cfg = load_model_config("tiny-vlm", ["foundation.num_layers=2", f"+fused_mlp={str(fused_mlp).lower()}"])
    kind, pcfg = LanguageModel.from_config(cfg, "cuda"), ParallelConfig()
    config = kind.transformer_config(pcfg, dtype=torch.float32, device_type="cuda")
    torch.manual_seed(0)
    (chunk,) = build_model_chunks(kind.provider(config, pcfg, device_type="cuda"), pcfg, config,
                                  get_accelerator("cuda"))  # fmt: skip
    return kind, chunk


def test_te_op_fuser_mlps_give_the_vlm_the_loss_and_gradients_of_megatrons_mlp(megatron_cuda):
    # model.fused_mlp: the foundation's and the ViT's SwiGLU MLPs become TE's op-fuser MLP (with
    # TE's wgrad accumulation into main_grad); the same parameters give the same loss and gradients
    from megatron.core.extensions.transformer_engine import TEFusedMLP

    runs = {}
    for fused in (False, True):
        kind, chunk = _chunk(fused)
        if fused:
            chunk.load_state_dict(runs[False][0])  # the same weights, under the same keys
        fused_mlps = [n for n, m in chunk.named_modules() if isinstance(m, TEFusedMLP)]
        n_layers = 2 + chunk.module.image_encoder.config.num_layers
        assert len(fused_mlps) == (n_layers if fused else 0), fused_mlps
        out, loss_func = kind.forward_step(torch.device("cuda"))(iter([step_batch()]), chunk)
        loss, count, _ = loss_func(out)
        (loss / count).backward()
        grads = {n: p.main_grad.clone() for n, p in chunk.module.named_parameters()}
        runs[fused] = (chunk.state_dict(), (loss / count).detach(), grads)
    torch.testing.assert_close(runs[True][1], runs[False][1], rtol=1e-4, atol=1e-5)
    assert runs[True][2].keys() == runs[False][2].keys()
    # each gradient's largest difference against the tensor's largest entry: 6.5e-4 at most as
    # measured (one of the two paths runs its fp32 GEMMs in TF32; 6.9e-7 with NVIDIA_TF32_OVERRIDE=0)
    for name, grad in runs[False][2].items():
        diff = (runs[True][2][name] - grad).abs().max() / grad.abs().max().clamp_min(1e-12)
        assert diff < 3e-3, f"{name}: gradient differs by {diff:.2e} of its largest entry"
    assert any("mlp.linear_fc1" in n and g.abs().sum() > 0 for n, g in runs[True][2].items())
