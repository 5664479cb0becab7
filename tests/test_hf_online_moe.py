"""The train app starts a MoE model (DeepSeek-V3: MLA, dense first layer, shared + routed experts)
from its HF directory at EP=2 and exports HF weights; same first loss as from the converted
checkpoint in one process."""

from __future__ import annotations

import json

import pytest
import torch

from loong_ckpt.testing.hf_models import make_hf_model
from loong_train.testing import TINY, make_runner

VOCAB = 8192  # covers the bundled 8k tokenizer


@pytest.mark.dist
def test_moe_from_hf_dir_at_ep2_equals_converted_checkpoint(tmp_path, data_cache):
    import transformers
    from safetensors.torch import load_file

    from loong_ckpt import hf_to_mcore

    # the model is the converted one: TINY's run settings without its model sizes
    run_train = make_runner(tmp_path, data_cache, [o for o in TINY if not o.startswith("model.")])
    hf = make_hf_model(tmp_path / "tiny-deepseek-v3", "deepseek-v3", vocab=VOCAB, max_shard_size="300KB")
    res = hf_to_mcore(hf, tmp_path / "ckpt", ep=2, progress=False)
    common = [f"hydra.searchpath=[file://{res.path}/configs]", f"model={res.model_name}", "train.steps=1",
              "train.eval_iters=0"]  # fmt: skip
    a = run_train(
        [*common, f"train.init_from={hf}", "parallel.ep=2", "train.export_hf=true"], nproc=2, name="ep2"
    )
    b = run_train([*common, f"train.init_from={res.path}"], name="ep1")
    a.check(), b.check()
    assert abs(a.losses()[1] - b.losses()[1]) < 1e-4

    # export from the EP=2 training checkpoint: every expert of every rank, the source config.json
    exported = a.out_dir / "hf" / "step_00000001"
    assert json.loads((exported / "config.json").read_text()) == json.loads((hf / "config.json").read_text())
    trained, source = {}, {}
    for f in exported.glob("*.safetensors"):
        trained.update(load_file(f))
    for f in hf.glob("*.safetensors"):
        source.update(load_file(f))
    assert sorted(trained) == sorted(source)
    moved = [k for k in source if ".mlp.experts." in k and not torch.equal(source[k], trained[k])]
    assert {int(k.split(".mlp.experts.")[1].split(".")[0]) for k in moved} == {
        0,
        1,
        2,
        3,
    }  # both ranks' experts
    model = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    assert torch.equal(
        model.model.layers[1].mlp.experts.down_proj[3],
        trained["model.layers.1.mlp.experts.3.down_proj.weight"],
    )
