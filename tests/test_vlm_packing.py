"""Packed multimodal micro-batches: several conversations (with their images and videos) share one
THD micro-batch of ``seq_length`` tokens, attention stays inside each sample in the LLM and inside
each image / video frame in the ViT, so the per-token loss and every gradient equal those of the
same samples trained one per micro-batch (fp32, CPU, the real bundled data and the tiny VLM)."""

from __future__ import annotations

import pytest
import torch

from loong_data.multimodal import PackedMultimodalDataset, bundled_multimodal_shards
from loong_data.testing import small_vision_processor
from loong_models import build_model, build_transformer_config, load_model_config, packed_seq_params
from loong_xpu.testing import megatron_cpu  # noqa: F401  (a one-process megatron world on the CPU)

pytestmark = pytest.mark.usefixtures("megatron_cpu")
SEQ = 512
MEDIA = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")


def _loss_and_grads(model, microbatches: list[dict]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The train app's step loss (sum of per-token losses over loss tokens / their count) and the
    gradients of every parameter."""
    model.zero_grad(set_to_none=True)
    total, count = torch.zeros((), dtype=torch.float64), 0.0
    for mb in microbatches:
        media = {k: mb[k] for k in MEDIA if mb[k].numel()}
        per_token = model(mb["tokens"], mb["position_ids"], None, labels=mb["labels"],
                          packed_seq_params=packed_seq_params(mb["cu_seqlens"], mb["max_seqlen"]), **media)  # fmt: skip
        loss_sum = (per_token.reshape(-1) * mb["loss_mask"].reshape(-1)).sum()
        loss_sum.backward()
        total += loss_sum.detach().double()
        count += float(mb["loss_mask"].sum())
    return total / count, {n: p.grad.clone() / count for n, p in model.named_parameters() if p.grad is not None}


def test_packed_microbatches_give_the_unpacked_loss_and_gradients(tmp_path):
    cfg = load_model_config("tiny-vlm", ["layer_backend=local"])
    config = build_transformer_config(cfg.foundation, params_dtype=torch.float32, use_cpu_initialization=True,
                                      calculate_per_token_loss=True)  # fmt: skip
    torch.manual_seed(0)
    model = build_model(cfg, config, device_type="cpu")
    e = cfg.image_encoder
    processor = small_vision_processor(e.patch_size, e.temporal_patch_size, e.spatial_merge_size)
    ds = PackedMultimodalDataset(bundled_multimodal_shards(tmp_path / "shards"), seq_length=SEQ, processor=processor,
                                 seed=0, shuffle_buffer=1)  # fmt: skip
    stream = ds.samples(0)
    samples = [next(stream) for _ in range(12)]
    videos = [s for s in samples if any(kind == "video" for kind, _ in s.media)]
    if not videos:  # the bundled set holds videos: make sure one is in the pack
        videos = [next(s for s in stream if any(kind == "video" for kind, _ in s.media))]
        samples[-1] = videos[0]
    packs = [ds.collate(p) for p in ds._pack(samples)]
    alone = [ds.collate([s]) for s in samples]
    assert len(packs) < len(samples) and max(len(p["cu_seqlens"]) - 1 for p in packs) >= 3, "nothing was packed"
    assert sum(int(p["image_grid_thw"].shape[0]) for p in packs) >= 5
    assert sum(int(p["video_grid_thw"].shape[0]) for p in packs) >= 1

    packed_loss, packed_grads = _loss_and_grads(model, packs)
    alone_loss, alone_grads = _loss_and_grads(model, alone)
    assert packed_loss.item() == pytest.approx(alone_loss.item(), abs=1e-5)
    assert packed_grads.keys() == alone_grads.keys()
    assert any(n.startswith("image_encoder.") for n in packed_grads)
    for name, grad in packed_grads.items():
        torch.testing.assert_close(grad, alone_grads[name], atol=1e-5, rtol=1e-4, msg=name)
