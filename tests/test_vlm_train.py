"""The default multimodal job (`train --config-name vlm`) end to end on CPU: a tiny VLM learns on
the bundled real images, writes a checkpoint, resumes on the same loss curve, refuses bad input
naming the key, runs DP=2 (torchrun, gloo) like one process, and its alignment phase leaves the
frozen components untouched."""

from __future__ import annotations

import shutil

import pytest
import torch

from loong_ckpt.mcore_io import read_metadata, read_regions
from loong_train.testing import make_runner

# The job as configured, shortened; a constant LR makes a 3-step run the prefix of a 6-step run.
VLM = ["--config-name=vlm", "train.tensorboard=false", "train.progress=false", "train.eval_iters=1"]
SHORT = ["train.steps=6", "train.eval_interval=3", "train.save_interval=3", "train.keep_last=5",
         "optim.schedule=constant", "optim.warmup_steps=0"]  # fmt: skip


@pytest.fixture
def run_vlm(tmp_path, data_cache):
    return make_runner(tmp_path, data_cache, defaults=VLM)


@pytest.fixture(scope="module")
def vlm_runner_factory(data_cache):
    return lambda base: make_runner(base, data_cache, defaults=VLM)


def _tensors(ckpt, prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    meta = read_metadata(ckpt)
    regions = {k: (tuple(0 for _ in m.size), torch.empty(m.size, dtype=m.properties.dtype))
               for k, m in meta.items() if k.startswith(prefixes)}  # fmt: skip
    read_regions(ckpt, regions)
    return {k: t for k, (_, t) in regions.items()}


def test_vlm_job_learns_checkpoints_and_resumes(run_vlm):
    full = run_vlm([*SHORT, "optim.lr=3e-3"], name="full").check()
    losses = full.losses()
    assert sorted(losses) == list(range(1, 7))
    assert losses[6] < losses[1] - 0.3, f"loss did not fall: {losses}"
    train = full.records("train")
    assert all(r["images_per_s"] > 0 and r["tokens_per_s"] > 0 for r in train)
    assert [r["step"] for r in full.records("val")] == [3, 6]
    ckpts = full.out_dir / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_00000006"
    assert (ckpts / "step_00000003" / "loong.json").is_file()

    # the same run killed after its step-3 checkpoint: resume from there, same losses after it
    half = full.out_dir.parent / "half"
    half.mkdir()
    (half / "checkpoints").mkdir()
    shutil.copytree(ckpts / "step_00000003", half / "checkpoints" / "step_00000003")
    (half / "checkpoints" / "latest").write_text("step_00000003\n")
    resumed = run_vlm([*SHORT, "optim.lr=3e-3", "resume=true"], name="half").check()
    assert "(step 3)" in resumed.stderr
    for step in (4, 5, 6):
        assert abs(resumed.losses()[step] - losses[step]) <= 1e-5, (
            step,
            resumed.losses()[step],
            losses[step],
        )


def test_text_model_on_image_data_fails_naming_the_key(run_vlm):
    run = run_vlm(["train.steps=1", "model=tiny"])
    assert run.returncode != 0
    assert (
        "config error: data.kind=multimodal (images in the data) but model.image_encoder is null"
        in run.stderr
    )
    assert "Traceback" not in run.stderr, run.stderr[-2000:]


def _compose(overrides: list[str]):
    from loong_train.main import to_config
    from loong_train.testing import compose_config

    return to_config(compose_config(*overrides, preset="vlm"))


@pytest.fixture(scope="module")
def text_only_tokenizer(tmp_path_factory):
    """An HF tokenizer folder with a chat template but no vision tokens (the bundled text BPE)."""
    from transformers import PreTrainedTokenizerFast

    from loong_data import default_tokenizer

    out = tmp_path_factory.mktemp("text-tokenizer")
    tok = PreTrainedTokenizerFast(tokenizer_file=str(default_tokenizer()))
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(out)
    return out


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.image_token_id=8100"], "model.image_token_id=8100 but the tokenizer"),
        (["data.tokenizer=TEXT_TOKENIZER"], "a vision chat tokenizer needs it"),
        (["data.packing=fixed"], "data.packing='fixed': multimodal data is packed"),
        (
            ["data.multimodal.jsonl=[/nonexistent/x.jsonl]"],
            "data.multimodal.jsonl: /nonexistent/x.jsonl not found",
        ),
        (["data.multimodal.val_shards=0"], "data.multimodal.val_shards=0"),
    ],
    ids=[
        "image-token-id-mismatch",
        "tokenizer-without-vision-tokens",
        "fixed-packing",
        "missing-jsonl",
        "no-val",
    ],
)
def test_bad_multimodal_config_names_the_key(overrides, message, text_only_tokenizer, tmp_path):
    from loong_data.step_data import DataError
    from loong_train.schema import ConfigError, validate
    from loong_train.trainer import run_data, step_layout

    overrides = [o.replace("TEXT_TOKENIZER", str(text_only_tokenizer)) for o in overrides]
    cfg = _compose([*overrides, f"data.cache_dir={tmp_path}"])
    with pytest.raises((ConfigError, DataError)) as e:
        run_data(cfg, step_layout(cfg, num_microbatches=validate(cfg, world_size=1)))
    assert message in str(e.value)


@pytest.fixture(scope="module")
def vlm_init(tmp_path_factory, vlm_runner_factory):
    """Initial weights (a steps=0 checkpoint) and a runner for module-scoped runs."""
    run = vlm_runner_factory(tmp_path_factory.mktemp("vlm-reference"))
    init = run(["train.steps=0"], name="init").check().out_dir / "checkpoints" / "step_00000000"
    return init, [f"train.init_from={init}", "train.steps=3", "train.eval_interval=0"], run


@pytest.fixture(scope="module")
def vlm_reference(vlm_init):
    """The single-process losses from the initial weights."""
    init, common, run = vlm_init
    return init, common, run(common, name="single").check().losses()


@pytest.mark.dist
@pytest.mark.parametrize(
    "layout",
    [
        [],  # DP=2: each rank packs and encodes its half of every global batch
        ["parallel.tp=2"],  # the image encoder split with the foundation
        # the image encoder replicated (TP=1) inside the foundation's TP=2 (saving, resuming and
        # exporting this layout: tests/test_vlm_layouts_ckpt.py)
        ["parallel.tp=2", "model.image_encoder.tensor_model_parallel_size=1"],
    ],
    ids=["dp2", "tp2", "tp2-encoder-tp1"],
)
def test_vlm_two_processes_match_single_process(vlm_reference, run_vlm, layout):
    """torchrun, 2 processes, gloo: the same losses as one process from the same weights."""
    _, common, single = vlm_reference
    losses = run_vlm([*common, *layout], nproc=2, name="two").check().losses()
    assert sorted(losses) == sorted(single)
    for step, loss in single.items():
        assert abs(losses[step] - loss) <= 1e-4, f"step {step}: {losses[step]} vs single-process {loss}"


def test_alignment_phase_trains_only_the_projector(vlm_init, run_vlm):
    init, common, _ = vlm_init
    run = run_vlm([*common, "phase=vlm-align"], name="align").check()
    assert "trainable params" in run.stderr
    final = run.out_dir / "checkpoints" / "step_00000003"
    components = ("foundation.", "image_encoder.", "image_projector.")
    before, after = _tensors(init, components), _tensors(final, components)
    assert before.keys() == after.keys() and any(k.startswith("image_projector.") for k in before)
    for key in before:
        if key.startswith("image_projector."):
            continue
        assert torch.equal(before[key], after[key]), f"{key} changed although its component is frozen"
    changed = [k for k in before if k.startswith("image_projector.") and not torch.equal(before[k], after[k])]
    assert changed, "the projector did not train"
