"""DeepSeek-V3 with YaRN RoPE scaling (its released long-context config): HF parity of the logits,
and the YaRN keys survive HF -> Loong -> HF."""

from __future__ import annotations

import json

import pytest
import torch

from loong_ckpt.testing import logits_in_process
from loong_ckpt.testing.hf_models import hf_logits, make_hf_model

# DeepSeek-V3's own values (factor 40 over 4096 positions), scaled to the tiny model's 256 positions.
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip


def test_deepseek_v3_with_yarn_matches_hf_logits_and_round_trips_its_config(tmp_path):
    from loong_ckpt import hf_to_mcore, mcore_to_hf

    hf = make_hf_model(tmp_path / "hf", "deepseek-v3", rope_parameters=dict(YARN))
    tokens = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
    torch.save(tokens, tmp_path / "tokens.pt")
    hf_to_mcore(hf, tmp_path / "ckpt", progress=False)
    meta = json.loads((tmp_path / "ckpt" / "loong.json").read_text())
    assert meta["foundation"]["rope_scaling"]["type"] == "yarn"
    want = hf_logits(hf, tokens)
    got = logits_in_process(tmp_path / "ckpt", tmp_path / "tokens.pt")
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    plain = make_hf_model(tmp_path / "plain", "deepseek-v3")  # the same weights without YaRN
    assert (hf_logits(plain, tokens) - want).abs().max() > 1e-3  # YaRN changes the outputs

    meta["hf_config"] = None  # export from the Loong config alone: the generated config keeps YaRN
    (tmp_path / "ckpt" / "loong.json").write_text(json.dumps(meta))
    mcore_to_hf(tmp_path / "ckpt", tmp_path / "out", progress=False)
    rope = json.loads((tmp_path / "out" / "config.json").read_text())["rope_parameters"]
    assert {k: rope[k] for k in YARN} == YARN


def test_yarn_on_a_gqa_family_is_refused_naming_the_key():
    from loong_models import FoundationConfig, RopeScaling

    with pytest.raises(ValueError, match=r"model.foundation.rope_scaling.type='yarn'; allowed for this attention: llama3"):
        FoundationConfig(rope_scaling=RopeScaling(type="yarn", factor=4.0)).validate()
