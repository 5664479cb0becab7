"""DeepSeek-V3 with multi-token-prediction layers (the released checkpoint's layout): conversion
maps them onto megatron's MTP block and back bit-identically; the main logits equal HF's (which
ignores MTP) and the MTP layer's logits equal DeepSeek's MTP definition computed with HF's own
decoder layer."""

from __future__ import annotations

import json

import pytest
import torch

from loong_ckpt.testing import logits_in_process
from loong_ckpt.testing.hf_models import add_mtp_layers, hf_logits, make_hf_model

PADDED_VOCAB = 1024  # the tiny models' 1000 tokens, padded to a multiple of 128


def _hf_tensors(path):
    from safetensors.torch import load_file

    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}


def _reference_mtp_logits(path, tokens):
    """DeepSeek-V3's MTP module (tech report §2.2) on HF's modules: the decoder's final hidden
    state h_i and token i+1's embedding -> eh_proj([enorm(emb); hnorm(h)]) -> the MTP decoder
    layer (HF layer num_hidden_layers) -> shared_head.norm -> the shared LM head."""
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cfg, n = model.config, model.config.num_hidden_layers
    # HF's loader reads the MTP layer's decoder tensors as one more decoder layer
    longer = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, num_hidden_layers=n + 1)
    layer = longer.eval().model.layers[n]
    w = {k.removeprefix(f"model.layers.{n}."): v for k, v in _hf_tensors(path).items()
         if k.startswith(f"model.layers.{n}.")}  # fmt: skip
    assert torch.equal(layer.self_attn.kv_b_proj.weight, w["self_attn.kv_b_proj.weight"])
    norms = {}
    for name in ("enorm", "hnorm", "shared_head.norm"):
        norms[name] = DeepseekV3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        norms[name].weight.data.copy_(w[name + ".weight"])
    with torch.no_grad():
        h = model.model(tokens).last_hidden_state[:, :-1]  # after the final norm, as megatron's MTP gets it
        emb = model.model.embed_tokens(tokens[:, 1:])
        x = torch.cat([norms["enorm"](emb), norms["hnorm"](h)], -1) @ w["eh_proj.weight"].T
        pos = torch.arange(x.shape[1]).unsqueeze(0)
        x = layer(x, attention_mask=None, position_ids=pos, position_embeddings=model.model.rotary_emb(x, pos))
        x = x[0] if isinstance(x, tuple) else x
        return model.lm_head(norms["shared_head.norm"](x))


def _loong_logits_with_mtp(source, tokens_file):
    """Loong's main logits and its MTP layer's logits (the output layer's first call in eval:
    megatron computes the MTP logits before the main ones)."""
    calls = []

    def hook(module, args, out):
        if type(module).__name__ == "ColumnParallelLinear" and out[0].shape[-1] == PADDED_VOCAB:
            calls.append(out[0].detach().transpose(0, 1).clone())  # the MTP loss overwrites them in place

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        main = logits_in_process(source, tokens_file)
    finally:
        handle.remove()
    assert len(calls) == 2 and torch.equal(calls[1][..., : main.shape[-1]], main)
    return main, calls[0][..., : main.shape[-1]]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from loong_ckpt import hf_to_mcore

    base = tmp_path_factory.mktemp("mtp")
    hf = add_mtp_layers(make_hf_model(base / "hf", "deepseek-v3"))
    hf_to_mcore(hf, base / "ckpt", progress=False)
    tokens = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.save(tokens, base / "tokens.pt")
    return hf, base / "ckpt", tokens, base


def test_mtp_layers_convert_to_megatrons_mtp_block_and_back_bit_identically(converted):
    from loong_ckpt import mcore_to_hf
    from loong_ckpt.mcore_io import read_metadata

    hf, ckpt, _, base = converted
    assert json.loads((ckpt / "loong.json").read_text())["foundation"]["mtp_num_layers"] == 1
    keys = set(read_metadata(ckpt))
    assert {"mtp.layers.0.eh_proj.weight", "mtp.layers.0.transformer_layer.mlp.router.expert_bias",
            "mtp.layers.0.transformer_layer.mlp.experts.experts.linear_fc1.weight"} <= keys  # fmt: skip
    mcore_to_hf(ckpt, base / "back", progress=False)
    src, back = _hf_tensors(hf), _hf_tensors(base / "back")
    assert sorted(back) == sorted(src)
    assert all(back[k].dtype == src[k].dtype and torch.equal(back[k], src[k]) for k in src)
    assert json.loads((base / "back" / "config.json").read_text())["num_nextn_predict_layers"] == 1

    meta = json.loads((ckpt / "loong.json").read_text())
    meta["hf_config"] = None  # the generated config.json says so too
    (ckpt / "loong.json").write_text(json.dumps(meta))
    mcore_to_hf(ckpt, base / "generated", progress=False)
    assert json.loads((base / "generated" / "config.json").read_text())["num_nextn_predict_layers"] == 1


@pytest.mark.parametrize("source", ["checkpoint", "hf-dir"])
def test_main_logits_match_hf_and_mtp_logits_match_deepseeks_mtp_on_hf_modules(converted, source):
    hf, ckpt, tokens, base = converted
    main, mtp = _loong_logits_with_mtp(ckpt if source == "checkpoint" else hf, base / "tokens.pt")
    torch.testing.assert_close(main, hf_logits(hf, tokens), atol=2e-4, rtol=1e-4)
    want = _reference_mtp_logits(hf, tokens)
    torch.testing.assert_close(mtp[:, :-1], want, atol=2e-4, rtol=1e-4)
    assert (mtp[:, :-1] - main[:, 1:]).abs().max() > 1e-2  # the MTP layer is not the decoder again


def test_an_mtp_copy_that_differs_from_the_main_embedding_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    from loong_ckpt import hf_to_mcore
    from loong_ckpt.hf_config import ConversionError

    hf = add_mtp_layers(make_hf_model(tmp_path / "hf", "deepseek-v3"))
    tensors = load_file(hf / "model.safetensors")
    tensors["model.layers.2.shared_head.head.weight"] += 1e-3
    save_file(tensors, str(hf / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=r"model.layers.2.shared_head.head.weight differs from lm_head.weight"):
        hf_to_mcore(hf, tmp_path / "ckpt", progress=False)
