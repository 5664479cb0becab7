"""A packed VLM micro-batch runs without reading device tensors back to the host (on a GPU each
read waits for every queued kernel):

- per-token RoPE (TokenRopeSelfAttention): the ViT's 2-D RoPE and the LLM's multimodal RoPE rotate
  the whole packed sequence at once, never megatron's per-segment THD path (a host read of every
  segment's offset, per layer), with megatron's exact result;
- the bookkeeping (multimodal positions, placeholder indices, ViT segments and windows) reads the
  host copies the forward step hands over. Device tensors are stood in for by a tensor type that
  fails on any host read."""

import pytest
import torch
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.transformer.attention import SelfAttention

from loong_models import (
    OmniCombinationModel,
    build_model,
    build_transformer_config,
    load_model_config,
    packed_seq_params,
)
from loong_models.attention.token_rope import TokenRopeSelfAttention
from loong_models.testing import packed_batch


def tiny_vlm():
    cfg = load_model_config("tiny-vlm", ["layer_backend=local", "foundation.num_layers=2"])
    config = build_transformer_config(cfg.foundation, params_dtype=torch.float32, use_cpu_initialization=True,
                                      calculate_per_token_loss=True)  # fmt: skip
    torch.manual_seed(0)
    return build_model(cfg, config, device_type="cpu")


def loss_and_grads(model) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**packed_batch())
    loss.sum().backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_vit_and_mrope_layers_use_per_token_rope_attention(megatron_cpu):
    model = tiny_vlm()
    for part in (model.image_encoder.decoder, model.foundation.decoder):
        assert all(isinstance(layer.self_attention, TokenRopeSelfAttention) for layer in part.layers)
    # a fused-kernel request only with TE layers
    assert not any(layer.self_attention.fused_rope for layer in model.image_encoder.decoder.layers)


def test_packed_vlm_never_takes_megatrons_per_segment_rope(megatron_cpu, monkeypatch):
    model = tiny_vlm()

    def per_segment(*args, **kwargs):
        raise AssertionError("megatron's THD RoPE (a host read per segment) was called")

    monkeypatch.setattr(rope_utils, "_apply_rotary_pos_emb_thd", per_segment)
    loss, grads = loss_and_grads(model)  # window layers, full-attention layers and the mrope LLM
    assert torch.isfinite(loss).all() and all(torch.isfinite(g).all() for g in grads.values())


def test_per_token_rope_equals_megatrons_per_segment_rope_exactly(megatron_cpu, monkeypatch):
    model = tiny_vlm()
    calls = []
    original = rope_utils._apply_rotary_pos_emb_thd
    monkeypatch.setattr(
        rope_utils, "_apply_rotary_pos_emb_thd", lambda *a, **k: calls.append(1) or original(*a, **k)
    )
    fast_loss, fast_grads = loss_and_grads(model)
    assert not calls
    monkeypatch.setattr(TokenRopeSelfAttention, "_per_token", lambda *a: False)  # megatron's own path
    ref_loss, ref_grads = loss_and_grads(model)
    assert calls  # the reference did go through megatron's per-segment RoPE
    assert torch.equal(fast_loss, ref_loss)
    for name, grad in ref_grads.items():
        assert torch.equal(fast_grads[name], grad), name


@pytest.mark.parametrize("rows, expected", [(12, True), (5, False)])
def test_only_a_table_with_one_row_per_token_skips_megatrons_path(megatron_cpu, rows, expected):
    """A table of max_seqlen rows restarts at every segment (text RoPE): megatron's path keeps it."""
    model = tiny_vlm()
    attn = model.foundation.decoder.layers[0].self_attention
    assert isinstance(attn, SelfAttention)
    params = packed_batch()["packed_seq_params"]
    hidden = torch.zeros(12, 1, model.config.hidden_size)
    assert attn._per_token(hidden, torch.zeros(rows, 1, 1, 64), params) is expected
    assert attn._per_token(hidden, torch.zeros(12, 1, 1, 64), None) is False  # not packed


HOST_READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__int__, torch.Tensor.__bool__,
              torch.Tensor.__index__, torch.Tensor.__float__, torch.Tensor.nonzero, torch.nonzero,
              torch.Tensor.cpu, torch.Tensor.numpy}  # fmt: skip


class DeviceOnly(torch.Tensor):
    """A tensor that refuses host reads, and so does everything computed from it."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            raise AssertionError(f"{func.__name__} read a device tensor on the host")
        return super().__torch_function__(func, types, args, kwargs)


def device_only(t: torch.Tensor) -> torch.Tensor:
    return t.clone().as_subclass(DeviceOnly)


def host_inputs(batch: dict) -> dict:
    """The forward step's keywords: device-only ids, pixels and segments, host copies beside them."""
    cu = batch["packed_seq_params"].cu_seqlens_q
    return dict(
        batch, input_ids=device_only(batch["input_ids"]), pixel_values=device_only(batch["pixel_values"]),
        pixel_values_videos=device_only(batch["pixel_values_videos"]),
        packed_seq_params=packed_seq_params(device_only(cu), batch["packed_seq_params"].max_seqlen_q, bounds=cu.tolist()),
        host_input_ids=batch["input_ids"],
    )  # fmt: skip


def test_device_only_refuses_host_reads():
    t = device_only(torch.tensor([1, 2]))
    for read in (t.tolist, t.item, lambda: int(t[0]), t.nonzero, t.cpu):
        with pytest.raises(AssertionError, match="read a device tensor"):
            read()
    assert type(t + 1) is DeviceOnly


def test_vlm_forward_with_host_copies_reads_nothing_back(megatron_cpu):
    """Token ids and segment boundaries on the host beside their device tensors (as the forward
    step passes them): no device tensor is read back, ViT and LLM attention (SDPA here) included."""
    model = tiny_vlm()
    assert isinstance(model, OmniCombinationModel)
    batch = packed_batch()
    inputs = host_inputs(batch)
    without = {k: v for k, v in inputs.items() if k != "host_input_ids"}
    without["packed_seq_params"] = packed_seq_params(inputs["packed_seq_params"].cu_seqlens_q, 23)
    with pytest.raises(AssertionError, match="read a device tensor"):  # the bookkeeping needs the copies
        model(**without)
    loss = model(**inputs)
    loss.sum().backward()
    with torch.no_grad():  # the same result as the forward that reads the device tensors
        torch.testing.assert_close(loss.detach(), model(**batch), rtol=0, atol=0)
