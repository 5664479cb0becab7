"""DeepSeek-V3.2 with its multi-token-prediction layer, as the release stores it (HF layer
num_hidden_layers: a DSA decoder layer with its own indexer, plus enorm / hnorm / eh_proj /
shared_head): conversion maps it onto megatron's MTP block and back bit-identically, offline and
online; the main logits equal HF's and the MTP logits equal DeepSeek's MTP definition computed on
HF's own DeepseekV32 layer."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from loong_ckpt.testing.hf_models import add_mtp_layers, hf_logits, make_hf_model
from loong_ckpt.testing.mtp import hf_tensors, loong_logits_with_mtp, reference_mtp_logits

PADDED_VOCAB = 1024  # the tiny models' 1000 tokens, padded to a multiple of 128
SEQ = 24  # the tiny model's index_topk is 8: queries past 8 drop keys, in the MTP layer too


@pytest.fixture(scope="module")
def v32mtp(tmp_path_factory):
    from loong_ckpt import hf_to_mcore

    base = tmp_path_factory.mktemp("v32mtp")
    hf = add_mtp_layers(make_hf_model(base / "hf", "deepseek-v32"))
    hf_to_mcore(hf, base / "ckpt", progress=False)
    tokens = torch.randint(0, 1000, (2, SEQ), generator=torch.Generator().manual_seed(0))
    torch.save(tokens, base / "tokens.pt")
    return hf, base / "ckpt", tokens, base


def test_the_mtp_layer_with_its_indexer_converts_to_megatrons_mtp_block_and_back_bit_identically(v32mtp, tmp_path):
    from loong_ckpt import mcore_to_hf
    from loong_ckpt.mcore_io import read_metadata

    hf, ckpt, _, _ = v32mtp
    assert json.loads((ckpt / "loong.json").read_text())["foundation"]["mtp_num_layers"] == 1
    keys = set(read_metadata(ckpt))
    layer = "mtp.layers.0.transformer_layer."
    assert {"mtp.layers.0.eh_proj.weight", layer + "self_attention.core_attention.indexer.linear_wq_b.weight",
            layer + "self_attention.core_attention.indexer.k_norm.bias",
            layer + "mlp.experts.experts.linear_fc1.weight"} <= keys  # fmt: skip
    mcore_to_hf(ckpt, tmp_path / "back", progress=False)
    src, back = hf_tensors(hf), hf_tensors(tmp_path / "back")
    assert "model.layers.2.self_attn.indexer.weights_proj.weight" in src and sorted(back) == sorted(src)
    assert all(back[k].dtype == src[k].dtype and torch.equal(back[k], src[k]) for k in src)
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == json.loads((hf / "config.json").read_text())

    shutil.copytree(ckpt, tmp_path / "ckpt")
    meta = json.loads((tmp_path / "ckpt" / "loong.json").read_text())
    meta["hf_config"] = None  # the generated config.json names the MTP layers too
    (tmp_path / "ckpt" / "loong.json").write_text(json.dumps(meta))
    mcore_to_hf(tmp_path / "ckpt", tmp_path / "generated", progress=False)
    generated = json.loads((tmp_path / "generated" / "config.json").read_text())
    assert generated["num_nextn_predict_layers"] == 1 and generated["index_topk"] == 8
    assert sorted(hf_tensors(tmp_path / "generated")) == sorted(src)


@pytest.mark.parametrize("source", ["checkpoint", "hf-dir"])
def test_main_logits_match_hf_and_mtp_logits_match_deepseeks_mtp_on_hf_v32_modules(v32mtp, source):
    hf, ckpt, tokens, base = v32mtp
    main, mtp = loong_logits_with_mtp(ckpt if source == "checkpoint" else hf, base / "tokens.pt", PADDED_VOCAB)
    torch.testing.assert_close(main, hf_logits(hf, tokens), atol=1e-4, rtol=1e-4)
    want = reference_mtp_logits(hf, tokens)
    torch.testing.assert_close(mtp[:, :-1], want, atol=2e-4, rtol=1e-4)
    assert (mtp[:, :-1] - main[:, 1:]).abs().max() > 1e-2  # the MTP layer is not the decoder again
