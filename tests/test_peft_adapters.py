"""LoRA adapters trained by the train app, exported in PEFT's layout: peft loads them onto the HF
base model and its outputs equal the merged export's (fused Q/K/V and gate/up adapters split)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from loong_ckpt.testing.hf_models import make_hf_model

STEPS = 3


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, runner_factory):
    from loong_ckpt import hf_to_mcore

    base = tmp_path_factory.mktemp("peft")
    hf = make_hf_model(base / "tiny-qwen2", "qwen2", vocab=8192)
    res = hf_to_mcore(hf, base / "ckpt", progress=False)  # only for the model's YAML
    runner = runner_factory(base)
    model = [f"hydra.searchpath=[file://{res.path}/configs]", f"model={res.model_name}"]
    run = runner(
        [*model, "phase=lora", "model.lora.rank=4", "model.lora.alpha=8", "optim.lr=1e-2", "optim.weight_decay=0.0",
         f"train.init_from={hf}", f"train.steps={STEPS}", "train.eval_iters=0", "train.export_hf=true"],
        name="lora",
    ).check()  # fmt: skip
    return SimpleNamespace(hf=hf, run=run, runner=runner, model=model)


def test_peft_loads_the_exported_adapters_with_the_merged_models_outputs(lora_run, tmp_path):
    import transformers
    from peft import PeftModel

    from loong_ckpt.cli import main

    hf, run = lora_run.hf, lora_run.run
    out = tmp_path / "adapter"
    assert main(["mcore-to-peft", str(run.out_dir / "checkpoints" / f"step_{STEPS:08d}"), str(out)]) == 0
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (4, 8.0, str(hf.absolute()))
    assert config["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])

    tokens = torch.randint(0, 8192, (2, 16), generator=torch.Generator().manual_seed(0))
    base = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    with torch.no_grad():
        base_logits = base(tokens).logits
        peft_model = PeftModel.from_pretrained(base, out)
        assert len([n for n, _ in peft_model.named_modules() if n.endswith(".lora_A")]) == 2 * 7  # 2 layers
        adapted = peft_model(tokens).logits
        merged_dir = run.out_dir / "hf" / f"step_{STEPS:08d}"  # the train app's merged export
        merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)(tokens).logits
    assert (adapted - base_logits).abs().max() > 1e-3  # the adapters trained
    torch.testing.assert_close(adapted, merged, atol=2e-5, rtol=1e-4)


def test_a_checkpoint_without_adapters_is_refused_naming_it(lora_run, tmp_path):
    from loong_ckpt.hf_config import ConversionError
    from loong_ckpt.peft import export_peft

    with pytest.raises(ConversionError, match="not a megatron distributed checkpoint|holds no LoRA adapters"):
        export_peft(lora_run.hf, tmp_path / "x")


TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def peft_adapter(lora_run, tmp_path_factory):
    """A PEFT adapter made by the peft package itself (random A and B, rank 2) on the HF base."""
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_pretrained(lora_run.hf, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=2, lora_alpha=4, target_modules=TARGETS, init_lora_weights=False))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.mul_(0.05)  # a small update, as a trained adapter's
    out = tmp_path_factory.mktemp("peft-made") / "adapter"
    model.save_pretrained(out)
    return out, model


@pytest.mark.dist
def test_training_continues_from_a_peft_adapter_with_its_exact_update_at_tp1_and_tp2(lora_run, peft_adapter):
    import transformers

    adapter, peft_model = peft_adapter
    tokens = torch.randint(0, 8192, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = peft_model(tokens).logits
    for nproc in (1, 2):  # rank 6 = 3 x 2: the Q/K/V parts stacked in one adapter; lr 0 keeps them
        cmd = [*lora_run.model, "phase=lora", "model.lora.rank=6", "model.lora.alpha=12",
               f"model.lora.init_from={adapter}", "optim.lr=0.0", "optim.min_lr=0.0", f"train.init_from={lora_run.hf}",
               "train.steps=1", "train.eval_iters=0", "train.export_hf=true", f"parallel.tp={nproc}"]  # fmt: skip
        done = lora_run.runner(cmd, nproc=nproc, name=f"from-peft-tp{nproc}").check()
        assert "loaded 16 LoRA adapter tensors from PEFT adapter" in done.stderr  # 2 layers x 4 linears x (A, B)
        merged = transformers.AutoModelForCausalLM.from_pretrained(done.out_dir / "hf" / "step_00000001",
                                                                   dtype=torch.float32)  # fmt: skip
        with torch.no_grad():
            got = merged(tokens).logits
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_loong_rank_too_small_for_the_stacked_parts_is_refused_naming_the_key(lora_run, peft_adapter):
    adapter, _ = peft_adapter
    failed = lora_run.runner([*lora_run.model, "phase=lora", "model.lora.rank=4", f"model.lora.init_from={adapter}",
                              f"train.init_from={lora_run.hf}", "train.steps=1"], name="small")  # fmt: skip
    assert failed.returncode != 0
    assert "3 projections of rank 2 share one Loong adapter: model.lora.rank must be >= 6 (got 4)" in failed.stderr
