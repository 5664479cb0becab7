"""VLM composition: configs (defaults list, backbone swap, overrides, parameter counts of the zoo
shapes), multimodal RoPE positions against HF, and the tiny VLM's forward / backward / freeze."""


import pytest
import torch

from loong_models import (
    ModelConfig,
    OmniCombinationModel,
    VisionTokenIds,
    build_model,
    build_transformer_config,
    load_model_config,
    mrope_positions,
    packed_seq_params,
)
from loong_models.testing import IMG, VID, hf_rope_index, packed_batch, vision_tokens

# Released checkpoints' parameter counts (vision tower included).
RELEASED_VLM = {"qwen2.5-vl-3b": 3_754_622_976, "qwen2.5-vl-7b": 8_292_166_656}


@pytest.mark.parametrize("name, count", RELEASED_VLM.items())
def test_vlm_parameter_counts_match_released_models(name, count):
    cfg = load_model_config(name)
    assert cfg.num_parameters() == count
    assert cfg.image_encoder.num_parameters() + cfg.image_projector.num_parameters(1280, 2, cfg.foundation.hidden_size) \
        == count - cfg.foundation.num_parameters()  # fmt: skip


def test_vlm_is_a_defaults_list_of_three_components():
    cfg = load_model_config("qwen2.5-vl-7b")
    assert cfg.image_encoder.type == "qwen2.5-vit" and cfg.image_encoder.fullatt_block_indexes == [
        7,
        15,
        23,
        31,
    ]
    assert cfg.image_projector.norm == "RMSNorm" and cfg.foundation.family == "qwen2"
    assert cfg.foundation.mrope_section == [16, 24, 24] and cfg.image_token_id == 151655
    custom = load_model_config("siglip-qwen3-1.7b")
    assert custom.image_encoder.type == "siglip" and custom.foundation.family == "qwen3"


def test_one_line_backbone_swap_and_component_overrides():
    cfg = load_model_config("qwen2.5-vl-7b", ["model/foundation=qwen3-8b", "+image_encoder.freeze=true",
                                              "image_encoder.recompute=full",
                                              "image_encoder.tensor_model_parallel_size=1"])  # fmt: skip
    assert cfg.foundation.family == "qwen3" and cfg.foundation.hidden_size == 4096
    assert cfg.foundation.mrope_section == [16, 24, 24]  # the VLM's own setting stays
    assert cfg.image_encoder.freeze and cfg.image_encoder.recompute == "full"
    assert cfg.image_encoder.tensor_model_parallel_size == 1 and not cfg.foundation.freeze
    assert cfg.num_parameters() == load_model_config("qwen3-8b").foundation.num_parameters() + (
        cfg.image_encoder.num_parameters() + cfg.image_projector.num_parameters(1280, 2, 4096)
    )


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["model/foundation=qwen3-0.6b"],
            r"mrope_section=\[8, 12, 12\] must be 3 numbers summing to head_dim / 2 = 64",
        ),
        (["image_token_id=9000"], "image_token_id=9000 is outside the vocabulary"),
        (["image_encoder.window_size=60"], "window_size=60 must be a positive multiple of"),
        (["+image_projector.tensor_model_parallel_size=2"], "the projector runs on the encoder's group"),
    ],
)
def test_bad_vlm_configs_name_the_key(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_model_config("tiny-vlm", overrides)


def test_mrope_positions_match_hf_get_rope_index_per_packed_document():
    docs = [  # (tokens, image grids, video grids, seconds per temporal grid)
        ([5, 6] + vision_tokens(IMG, (1, 4, 6)) + [7, 8, 9] + vision_tokens(VID, (3, 4, 4)) + [10],
         [[1, 4, 6]], [[3, 4, 4]], [0.5]),
        ([11, 12, 13, 14, 15], None, None, None),
        (vision_tokens(IMG, (1, 2, 8)) + vision_tokens(IMG, (1, 6, 2)) + [3] + vision_tokens(VID, (2, 2, 2)) + [4, 4],
         [[1, 2, 8], [1, 6, 2]], [[2, 2, 2]], [1.5]),
    ]  # fmt: skip
    tokens = torch.tensor([sum((d[0] for d in docs), [])])
    images = torch.tensor([g for d in docs for g in d[1] or []])
    videos = torch.tensor([g for d in docs for g in d[2] or []])
    seconds = [s for d in docs for s in d[3] or []]
    cu = torch.tensor([0, *torch.tensor([len(d[0]) for d in docs]).cumsum(0).tolist()], dtype=torch.int32)
    ours = mrope_positions(tokens, VisionTokenIds(IMG, VID), spatial_merge_size=2, image_grid_thw=images,
                           video_grid_thw=videos, second_per_grid_ts=seconds, tokens_per_second=2,
                           cu_seqlens=cu)  # fmt: skip
    hf = []
    for doc, im, vid, sec in docs:
        if im is None:  # text only: HF's plain positions (get_rope_index expects vision)
            hf.append(torch.arange(len(doc)).expand(3, 1, -1))
        else:
            hf.append(hf_rope_index(doc, torch.tensor(im), torch.tensor(vid), torch.tensor(sec)))
    torch.testing.assert_close(ours, torch.cat(hf, dim=-1), rtol=0, atol=0)


def test_mrope_positions_reject_a_mismatch():
    tokens = torch.tensor([[1] + vision_tokens(IMG, (1, 4, 4))])
    with pytest.raises(ValueError, match="more image placeholder tokens than image_grid_thw rows"):
        mrope_positions(
            tokens, VisionTokenIds(IMG, VID), spatial_merge_size=2, image_grid_thw=torch.zeros(0, 3)
        )
    with pytest.raises(ValueError, match="needs 8 placeholder tokens, found a run of 4"):
        mrope_positions(tokens, VisionTokenIds(IMG, VID), spatial_merge_size=2,
                        image_grid_thw=torch.tensor([[2, 4, 4]]))  # fmt: skip


# --- the tiny VLM, built ---


def tiny_vlm(overrides=()) -> tuple[ModelConfig, OmniCombinationModel]:
    cfg = load_model_config("tiny-vlm", ["layer_backend=local", "foundation.num_layers=2", *overrides])
    config = build_transformer_config(cfg.foundation, params_dtype=torch.float32, use_cpu_initialization=True,
                                      calculate_per_token_loss=True)  # fmt: skip
    return cfg, build_model(cfg, config, device_type="cpu")


def test_tiny_vlm_builds_what_the_config_counts(megatron_cpu):
    cfg, model = tiny_vlm()
    padding = (cfg.foundation.padded_vocab_size() - cfg.foundation.vocab_size) * cfg.foundation.hidden_size
    assert sum(p.numel() for p in model.parameters()) == cfg.num_parameters() + padding  # tied embeddings
    assert isinstance(model, OmniCombinationModel) and model.foundation.position_embedding_type == "mrope"


def test_tiny_vlm_forward_backward(megatron_cpu):
    _, model = tiny_vlm()
    batch = packed_batch()
    loss = model(**batch)
    assert loss.shape == batch["input_ids"].shape and torch.isfinite(loss).all()
    loss.sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
    for module in (model.image_encoder, model.image_projector):
        assert all(p.grad.abs().sum() > 0 for p in module.parameters())
    # the image features reach the loss: other pixels, other loss
    changed = dict(batch, pixel_values=batch["pixel_values"] + 1.0)
    with torch.no_grad():
        assert not torch.allclose(model(**changed), loss)


def test_vision_tokens_do_not_leak_across_documents(megatron_cpu):
    _, model = tiny_vlm()
    batch = packed_batch()
    n1 = int(batch["packed_seq_params"].cu_seqlens_q[1])
    with torch.no_grad():
        packed = model(**batch)
        alone = model(batch["input_ids"][:, n1:], None, None, labels=batch["labels"][:, n1:],
                      packed_seq_params=packed_seq_params(torch.tensor([0, 5], dtype=torch.int32), 5))  # fmt: skip
    torch.testing.assert_close(packed[:, n1:], alone, atol=1e-5, rtol=1e-5)


def test_freeze_leaves_encoder_grads_none(megatron_cpu):
    _, model = tiny_vlm(["+image_encoder.freeze=true"])
    model(**packed_batch()).sum().backward()
    assert all(p.grad is None for p in model.image_encoder.parameters())
    assert all(p.grad is not None for p in model.image_projector.parameters())
    assert all(p.grad is not None for p in model.foundation.parameters())


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_encoder_recompute_gives_the_same_gradients(megatron_cpu, recompute):
    grads = []
    for extra in ([], [f"image_encoder.recompute={recompute}"]):
        torch.manual_seed(0)
        _, model = tiny_vlm(extra)
        assert model.image_encoder.config.recompute_granularity == (recompute if extra else None)
        assert model.foundation.config.recompute_granularity is None  # the component's own setting
        model(**packed_batch()).sum().backward()
        grads.append({n: p.grad for n, p in model.image_encoder.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, msg=name)


def test_text_only_pack_with_empty_media_keys(megatron_cpu):
    _, model = tiny_vlm()
    tokens = torch.tensor([[5, 6, 7, 8, 9, 10]])
    empty = dict(pixel_values=torch.zeros(0, 1176), image_grid_thw=torch.zeros(0, 3, dtype=torch.long),
                 pixel_values_videos=torch.zeros(0, 1176), video_grid_thw=torch.zeros(0, 3, dtype=torch.long))  # fmt: skip
    with torch.no_grad():
        loss = model(tokens, None, None, labels=tokens, **empty)
        plain = model(tokens, None, None, labels=tokens)  # no media keys at all
    assert torch.isfinite(loss).all()
    torch.testing.assert_close(loss, plain)


def test_placeholder_count_mismatch_is_reported(megatron_cpu):
    _, model = tiny_vlm()
    batch = packed_batch()
    batch["image_grid_thw"] = torch.tensor([[1, 4, 4]])
    batch["pixel_values"] = batch["pixel_values"][:16]
    with pytest.raises(ValueError, match="image"):
        model(**batch)


def test_sharded_state_dict_covers_every_component(megatron_cpu):
    """megatron's distributed checkpointing (loong-ckpt training.py) reads sharded_state_dict()."""
    _, model = tiny_vlm()
    keys = {k for k in model.sharded_state_dict() if not k.endswith("_extra_state")}
    params = {n for n, _ in model.named_parameters()}
    assert params <= keys, sorted(params - keys)[:5]
    assert any(k.startswith("image_encoder.decoder.layers.") for k in keys)
    assert any(k.startswith("image_projector.mlp.") for k in keys)
