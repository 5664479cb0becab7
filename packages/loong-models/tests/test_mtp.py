"""Multi-token prediction (DeepSeek-V3's MTP layers, megatron's MTP block): the model builds them
with the configured size, their loss reaches their parameters and the decoder's, in proportion to
``mtp_loss_scaling_factor``; bad values name the key."""

import dataclasses

import pytest
import torch

from loong_models import ModelConfig, build_model, build_transformer_config, load_model_config


def _build(f):
    config = build_transformer_config(f, use_cpu_initialization=True, calculate_per_token_loss=True,
                                      moe_token_dispatcher_type="alltoall")  # fmt: skip
    torch.manual_seed(0)
    return build_model(ModelConfig(foundation=f, layer_backend="local"), config, device_type="cpu")


def _grads(f, factor: float) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of the summed LM loss of one batch (+ the MTP loss megatron
    attaches to the hidden states, with a backward scale of 1)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    model_parallel_cuda_manual_seed(0)
    model = _build(dataclasses.replace(f, mtp_loss_scaling_factor=factor))
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, f.vocab_size, (2, 16), generator=g)
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    loss = model(tokens, torch.arange(16).expand(2, 16), None, labels=torch.roll(tokens, -1, 1))
    loss.sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_mtp_layers_are_built_and_counted(megatron_cpu):
    f = dataclasses.replace(load_model_config("deepseek-v3-tiny").foundation, mtp_num_layers=2)
    model = _build(f)
    assert len(model.mtp.layers) == 2 and type(model.mtp.layers[0].mtp_model_layer.mlp).__name__ == "MoELayer"
    buffers = sum(b.numel() for n, b in model.named_buffers() if n.endswith("router.expert_bias"))
    assert sum(p.numel() for p in model.parameters()) + buffers == f.num_parameters()
    assert f.num_parameters() > dataclasses.replace(f, mtp_num_layers=None).num_parameters()


def test_the_mtp_loss_reaches_the_mtp_layer_and_the_decoder_scaled_by_its_factor(megatron_cpu):
    f = load_model_config("deepseek-v3-tiny").foundation
    # without the routers' balancing loss, which reaches the MTP layer's router whatever the factor
    f = dataclasses.replace(f, mtp_num_layers=1, moe=dataclasses.replace(f.moe, aux_loss_coeff=0.0))
    off, a, b = _grads(f, 0.0), _grads(f, 0.1), _grads(f, 0.3)
    mtp = [n for n in a if n.startswith("mtp.")]
    assert len(mtp) > 10 and [n for n in mtp if a[n].abs().sum() == 0] == []  # every MTP parameter learns
    assert all(off[n].abs().sum() == 0 for n in mtp)  # factor 0: no MTP gradient
    for n in ("embedding.word_embeddings.weight", "decoder.layers.0.self_attention.linear_proj.weight"):
        assert (a[n] - off[n]).abs().max() > 1e-6  # the MTP loss trains the shared embedding and the decoder
        torch.testing.assert_close(b[n] - off[n], 3 * (a[n] - off[n]), atol=1e-6, rtol=1e-3)


@pytest.mark.parametrize("key, value, message", [
    ("mtp_num_layers", 0, r"model.foundation.mtp_num_layers=0; expected null \(no MTP\) or >= 1"),
    ("mtp_loss_scaling_factor", -0.1, r"model.foundation.mtp_loss_scaling_factor=-0.1; expected >= 0"),
])  # fmt: skip
def test_bad_mtp_settings_are_refused_naming_the_key(key, value, message):
    f = dataclasses.replace(load_model_config("deepseek-v3-tiny").foundation, **{key: value})
    with pytest.raises(ValueError, match=message):
        f.validate()


def test_chunkpipe_refuses_a_model_with_mtp_layers_naming_the_key(megatron_cpu):
    from loong_models.chunked import enable_chunkpipe

    f = dataclasses.replace(load_model_config("tiny").foundation, mtp_num_layers=1)  # MTP on a GQA model too
    model = _build(f)
    assert len(model.mtp.layers) == 1
    with pytest.raises(ValueError, match=r"ChunkPipe does not support multi-token prediction; set "
                                         r"model.foundation.mtp_num_layers=null"):  # fmt: skip
        enable_chunkpipe(model)
