"""Qwen3-VL through the same composition: tiny-qwen3-vl swaps for tiny-vlm with one line, builds
what its config counts (DeepStack mergers included), trains (forward / backward through DeepStack,
also under full recompute of the LLM) and keeps packed documents apart. HF parity is in
loong-ckpt's test_convert_qwen3_vl.py."""

import pytest
import torch

from loong_models import build_model, build_transformer_config, load_model_config, packed_seq_params
from loong_models.foundation.deepstack import DeepStackLayer
from loong_models.foundation.mrope import InterleavedMultimodalRotaryEmbedding
from loong_models.testing import packed_batch

PATCH_DIM = 3 * 2 * 16 * 16


def tiny_qwen3_vl(overrides=()):
    cfg = load_model_config("tiny-qwen3-vl", ["layer_backend=local", *overrides])
    config = build_transformer_config(cfg.foundation, params_dtype=torch.float32, use_cpu_initialization=True,
                                      calculate_per_token_loss=True, **cfg.foundation.extra)  # fmt: skip
    return cfg, build_model(cfg, config, device_type="cpu")


def test_one_line_swap_between_vlm_families():
    """model=tiny-qwen3-vl vs model=tiny-vlm: the same three components, other kinds of each."""
    qwen25, qwen3 = load_model_config("tiny-vlm"), load_model_config("tiny-qwen3-vl")
    assert (qwen25.image_encoder.type, qwen3.image_encoder.type) == ("qwen2.5-vit", "qwen3-vit")
    assert (qwen25.image_projector.norm, qwen3.image_projector.norm) == ("RMSNorm", "LayerNorm")
    assert (qwen25.foundation.family, qwen3.foundation.family) == ("llama", "qwen3")
    assert qwen3.foundation.mrope_interleaved and not qwen25.foundation.mrope_interleaved
    assert (
        qwen3.image_encoder.deepstack_visual_indexes == [0, 1]
        and qwen3.image_token_id == qwen25.image_token_id
    )


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["image_encoder.deepstack_visual_indexes=[0,3]"],
            r"deepstack_visual_indexes has \[3\], outside 0..2",
        ),
        (["image_encoder.deepstack_visual_indexes=[1,1]"], "lists a layer twice"),
        (["foundation.num_layers=1"], "feeds 2 foundation layers but model.foundation.num_layers=1"),
        (["foundation.mrope_section=null"], "mrope_interleaved=true needs model.foundation.mrope_section"),
    ],
)
def test_bad_qwen3_vl_configs_name_the_key(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_model_config("tiny-qwen3-vl", overrides)


def test_tiny_qwen3_vl_builds_what_the_config_counts(megatron_cpu):
    cfg, model = tiny_qwen3_vl()
    padding = (cfg.foundation.padded_vocab_size() - cfg.foundation.vocab_size) * cfg.foundation.hidden_size
    assert sum(p.numel() for p in model.parameters()) == cfg.num_parameters() + padding  # tied embeddings
    assert len(model.image_projector.deepstack) == 2
    assert isinstance(model.foundation.rotary_pos_emb, InterleavedMultimodalRotaryEmbedding)
    assert all(isinstance(layer, DeepStackLayer) for layer in model.foundation.decoder.layers)
    keys = set(model.sharded_state_dict())
    assert "image_projector.deepstack.1.mlp.linear_fc1.weight" in keys
    assert "image_encoder.position_embedding.weight" in keys


def _grads(overrides=()):
    torch.manual_seed(0)
    _, model = tiny_qwen3_vl(overrides)
    assert model.foundation.config.recompute_granularity == ("full" if overrides else None)
    batch = packed_batch(patch_dim=PATCH_DIM)
    loss = model(**batch)
    loss.sum().backward()
    return loss, {n: p.grad for n, p in model.named_parameters()}


def test_forward_backward_reaches_every_deepstack_merger(megatron_cpu):
    loss, grads = _grads()
    assert torch.isfinite(loss).all()
    assert all(g is not None for g in grads.values())
    for j in (0, 1):
        assert grads[f"image_projector.deepstack.{j}.mlp.linear_fc2.weight"].abs().sum() > 0


def test_full_recompute_of_the_llm_keeps_deepstack(megatron_cpu):
    """DeepStack features travel as a checkpointed input: the recomputed layers add them again."""
    loss, grads = _grads()
    loss_r, grads_r = _grads(["+foundation.recompute=full"])
    torch.testing.assert_close(loss_r, loss)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_r[name], grad, msg=name)


def test_vision_tokens_do_not_leak_across_documents(megatron_cpu):
    _, model = tiny_qwen3_vl()
    batch = packed_batch(patch_dim=PATCH_DIM)
    n1 = int(batch["packed_seq_params"].cu_seqlens_q[1])
    with torch.no_grad():
        packed = model(**batch)
        alone = model(batch["input_ids"][:, n1:], None, None, labels=batch["labels"][:, n1:],
                      packed_seq_params=packed_seq_params(torch.tensor([0, 5], dtype=torch.int32), 5))  # fmt: skip
    torch.testing.assert_close(packed[:, n1:], alone, atol=1e-5, rtol=1e-5)
