"""LoRA through the real train app: only adapters train and are saved, resume continues the same
loss curve, the merged HF export equals the model with adapters, TP=2 equals TP=1; phase errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from loong_xpu.testing import (
    launch_env,
    megatron_cpu,  # noqa: F401  (fixture: a one-process megatron world)
)

LORA = ["phase=lora", "model.lora.rank=4", "model.lora.alpha=8", "optim.lr=1e-2", "train.eval_iters=0"]
STEPS = 6


def _hf_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in path.glob("*.safetensors") for k, v in load_file(f).items()}


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@pytest.fixture(scope="module")
def base_and_lora(tmp_path_factory, runner_factory):
    """A base checkpoint (2 steps of pre-training) and a LoRA run on it (saved every 3 steps, HF export)."""
    run = runner_factory(tmp_path_factory.mktemp("lora"))
    base = run(["train.steps=2", "train.eval_iters=0"], name="base").check()
    base_ckpt = base.out_dir / "checkpoints" / "step_00000002"
    lora = run([*LORA, f"train.steps={STEPS}", "train.save_interval=3", "train.keep_last=5",
                f"train.init_from={base_ckpt}", "train.export_hf=true"], name="lora").check()  # fmt: skip
    return run, base_ckpt, lora


def test_checkpoint_holds_only_the_adapters(base_and_lora):
    from loong_ckpt.mcore_io import read_metadata

    _, base_ckpt, lora = base_and_lora
    ckpt = lora.out_dir / "checkpoints" / f"step_{STEPS:08d}"
    keys = set(read_metadata(ckpt))
    model_keys = {k for k in keys if not k.startswith("optimizer")}
    assert model_keys == {f"decoder.layers.{m}.{p}" for m in ("self_attention.linear_qkv", "self_attention.linear_proj",
                          "mlp.linear_fc1", "mlp.linear_fc2") for p in ("lora_a", "lora_b")}  # fmt: skip
    optim_keys = keys - model_keys
    assert optim_keys and all(".lora_" in k for k in optim_keys)  # Adam moments of the adapters only
    assert _dir_bytes(ckpt) < 0.1 * _dir_bytes(base_ckpt), (_dir_bytes(ckpt), _dir_bytes(base_ckpt))
    meta = json.loads((ckpt / "loong.json").read_text())
    assert meta["params"] == "trainable" and meta["lora"]["base"] == str(base_ckpt.absolute())
    assert meta["lora"]["rank"] == 4 and meta["lora"]["alpha"] == 8
    assert sorted(lora.losses()) == list(range(1, STEPS + 1))


def test_resume_reloads_base_and_adapters_on_the_same_loss_curve(base_and_lora):
    run, base_ckpt, lora = base_and_lora
    # the run as if killed after its step-3 checkpoint
    out = lora.out_dir.parent / "resumed"
    shutil.copytree(lora.out_dir, out, ignore=shutil.ignore_patterns(f"step_{STEPS:08d}", "hf"))
    (out / "checkpoints" / "latest").unlink()
    resumed = run([*LORA, f"train.steps={STEPS}", "train.save_interval=3", "train.keep_last=5",
                   f"train.init_from={base_ckpt}", "resume=true"], name=out.name).check()  # fmt: skip
    assert "(step 3)" in resumed.stderr
    want, got = lora.losses(), resumed.losses()
    for step in range(4, STEPS + 1):
        assert abs(got[step] - want[step]) <= 1e-5, (step, got[step], want[step])


def test_resume_needs_the_same_base(base_and_lora):
    run, base_ckpt, lora = base_and_lora
    out = lora.out_dir.parent / "other-base"
    shutil.copytree(lora.out_dir, out, ignore=shutil.ignore_patterns("hf"))
    other_base = base_ckpt.parent.parent.parent / "base-copy"
    shutil.copytree(base_ckpt, other_base)
    other = run(
        [*LORA, f"train.steps={STEPS + 1}", "train.resume_schedule=rescale", f"train.init_from={other_base}",
         "resume=true"], name=out.name,
    )  # fmt: skip
    assert other.returncode != 0
    assert f"was trained on {base_ckpt.absolute()}" in other.stderr


def _model_with_adapters(ckpt: Path, load_base):
    """The Loong model of a LoRA checkpoint, in this process: base weights by ``load_base(model, f)``,
    then the adapters."""
    from loong_ckpt.hf_config import foundation_from_dict
    from loong_ckpt.training import load_checkpoint
    from loong_models import LoraConfig, ModelConfig, build_model, build_transformer_config

    meta = json.loads((ckpt / "loong.json").read_text())
    f = foundation_from_dict(meta["foundation"])
    lcfg = LoraConfig(**{k: v for k, v in meta["lora"].items() if k != "base"})
    config = build_transformer_config(f, use_cpu_initialization=True, params_dtype=torch.float32)
    model = build_model(
        ModelConfig(foundation=f, layer_backend="local", lora=lcfg), config, device_type="cpu"
    )
    load_base(model, f)
    load_checkpoint(ckpt, [model])  # the adapters
    assert any(torch.count_nonzero(p) for n, p in model.named_parameters() if n.endswith("lora_b"))
    return model.eval(), f


def _assert_same_logits(model, f, hf_dir: Path) -> None:
    import transformers

    tokens = torch.randint(0, f.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(tokens, torch.arange(24).expand(2, -1), None)[..., : f.vocab_size]
        hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        theirs = hf(tokens).logits
    assert (ours - theirs).abs().max().item() <= 1e-4


def test_merged_export_equals_the_model_with_adapters(base_and_lora, megatron_cpu, tmp_path):  # noqa: F811
    from loong_ckpt.cli import main as convert_main
    from loong_ckpt.training import load_checkpoint

    _, base_ckpt, lora = base_and_lora
    ckpt = lora.out_dir / "checkpoints" / f"step_{STEPS:08d}"
    model, f = _model_with_adapters(ckpt, lambda m, _: load_checkpoint(base_ckpt, [m], part="frozen"))
    exported = lora.out_dir / "hf" / f"step_{STEPS:08d}"
    _assert_same_logits(model, f, exported)

    # loong-convert on the adapters-only checkpoint writes the same merged weights
    assert convert_main(["mcore-to-hf", str(ckpt), str(tmp_path / "cli"), "--no-progress"]) == 0
    a, b = _hf_tensors(exported), _hf_tensors(tmp_path / "cli")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_lora_on_an_hf_base_exports_merged_weights(runner_factory, tmp_path_factory, megatron_cpu):  # noqa: F811
    from loong_ckpt.online import load_hf_weights
    from loong_ckpt.testing.hf_models import make_hf_model

    base = tmp_path_factory.mktemp("lora-hf")
    hf = make_hf_model(base / "tiny-qwen2", "qwen2", vocab=8192)  # Q/K/V biases, untied head
    # for its model YAML; in a subprocess: this one already holds a megatron world
    subprocess.run([sys.executable, "-m", "loong_ckpt.cli", "hf-to-mcore", str(hf), str(base / "conv"), "--no-progress"],
                   check=True, env=launch_env())  # fmt: skip
    run = runner_factory(base)
    out = run([f"hydra.searchpath=[file://{base / 'conv'}/configs]", "model=tiny-qwen2", *LORA, "train.steps=3",
               f"train.init_from={hf}", "train.export_hf=true"], name="lora-hf").check()  # fmt: skip
    ckpt = out.out_dir / "checkpoints" / "step_00000003"
    model, f = _model_with_adapters(ckpt, lambda m, f: load_hf_weights(hf, [m], f))
    exported = out.out_dir / "hf" / "step_00000003"
    _assert_same_logits(model, f, exported)
    assert json.loads((exported / "config.json").read_text()) == json.loads((hf / "config.json").read_text())
    source, merged = _hf_tensors(hf), _hf_tensors(exported)
    for k in source:  # only the adapted projections moved
        adapted = any(
            p in k for p in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "mlp.")
        )
        assert torch.equal(source[k], merged[k]) != adapted, k


def test_lora_needs_init_from_and_align_needs_something_to_train(run_train):
    no_base = run_train([*LORA, "train.steps=1"], name="no-base")
    assert no_base.returncode != 0 and "model.lora needs train.init_from" in no_base.stderr
    frozen = run_train(["phase=align", "train.steps=1"], name="all-frozen")
    assert frozen.returncode != 0 and "nothing to train: every parameter is frozen" in frozen.stderr


@pytest.mark.dist
@pytest.mark.parametrize(
    "layout",
    [
        ["parallel.tp=2", "parallel.sequence_parallel=true"],  # TP=2 with SP: one launch covers both
        ["parallel.distributed_optimizer=true"],
        ["parallel.pp=2"],
    ],
    ids=["tp2-sp", "dp2-distopt", "pp2"],
)
def test_lora_at_two_processes_equals_one(base_and_lora, layout):
    run, base_ckpt, lora = base_and_lora
    name = "-".join(x.split(".")[-1].split("=")[0] for x in layout)  # no '=' in a Hydra value
    two = run([*LORA, f"train.steps={STEPS}", f"train.init_from={base_ckpt}", "train.export_hf=true", *layout],
              nproc=2, name=name).check()  # fmt: skip
    want, got = lora.losses(), two.losses()
    for step in range(1, STEPS + 1):
        assert abs(got[step] - want[step]) <= 1e-4, (step, got[step], want[step])
    # adapters saved under TP=2 merge into the same HF weights as under TP=1
    a, b = (_hf_tensors(r.out_dir / "hf" / f"step_{STEPS:08d}") for r in (lora, two))
    assert sorted(a) == sorted(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)
