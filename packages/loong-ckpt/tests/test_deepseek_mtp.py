"""DeepSeek-V3 with multi-token-prediction layers (the released checkpoint's layout): conversion
maps them onto megatron's MTP block and back bit-identically; the main logits equal HF's (which
ignores MTP) and the MTP layer's logits equal DeepSeek's MTP definition computed with HF's own
decoder layer."""

from __future__ import annotations

import json

import pytest
import torch

from loong_ckpt.testing.hf_models import add_mtp_layers, hf_logits, make_hf_model
from loong_ckpt.testing.mtp import hf_tensors, loong_logits_with_mtp, reference_mtp_logits

PADDED_VOCAB = 1024  # the tiny models' 1000 tokens, padded to a multiple of 128


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
    src, back = hf_tensors(hf), hf_tensors(base / "back")
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
    main, mtp = loong_logits_with_mtp(ckpt if source == "checkpoint" else hf, base / "tokens.pt", PADDED_VOCAB)
    torch.testing.assert_close(main, hf_logits(hf, tokens), atol=2e-4, rtol=1e-4)
    want = reference_mtp_logits(hf, tokens)
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
