"""`train --megatron`: Megatron-LM / LoongForge launch flags become Loong's config, through one table."""

from __future__ import annotations

import subprocess
import sys

import pytest

from loong_train.main import to_config
from loong_train.megatron_args import ARG_MAP, MegatronArgError, translate
from loong_train.testing import Run, compose_config, train_command
from loong_xpu.testing import launch_env


def resolved(overrides: list[str]):
    """The validated Config that `train <overrides>` would run with."""
    return to_config(compose_config(*overrides))


def _script_paths(tmp_path):
    data = tmp_path / "corpus.jsonl"
    data.write_text('{"text": "to be or not to be"}\n')
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")  # what --load of an HF model directory sees
    return data, tmp_path / "ckpt", tmp_path / "tb"


# Three launch lines in the style of LoongForge's examples/ (their flags, local paths).
def qwen25_pretrain(data, ckpt, tb) -> list[str]:
    return (f"--model-name qwen2.5-0.5b --rotary-base 1000000 --rotary-seq-len-interpolation-factor 1 "
            f"--tokenizer-type HFTokenizer --hf-tokenizer-path /models/Qwen2.5-0.5B --eod-mask-loss "
            f"--data-path {data} --split 99,1,0 --training-phase pretrain --seq-length 4096 "
            "--max-position-embeddings 32768 --init-method-std 0.006 --micro-batch-size 4 --global-batch-size 1024 "
            "--lr 1.0e-5 --min-lr 1.0e-6 --clip-grad 1.0 --weight-decay 0.1 --optimizer adam --adam-beta1 0.9 "
            "--adam-beta2 0.95 --adam-eps 1e-08 --norm-epsilon 1e-6 --train-iters 50000 --lr-decay-iters 50000 "
            f"--lr-decay-style cosine --lr-warmup-fraction 0.002 --initial-loss-scale 65536 --bf16 --load {ckpt} "
            f"--save {ckpt} --save-interval 5000 --eval-interval 1000 --eval-iters 10 --tensor-model-parallel-size 1 "
            "--pipeline-model-parallel-size 1 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather "
            f"--distributed-backend nccl --log-interval 1 --tensorboard-dir {tb} --log-timers-to-tensorboard").split()  # fmt: skip


def qwen3_sft(data, ckpt, tb) -> list[str]:
    return (f"--model-name qwen3-0.6b --rotary-base 1000000 --tokenizer-type HFTokenizer "
            f"--hf-tokenizer-path /models/Qwen3-0.6B --data-path {data} --split 100,0,0 --chat-template qwen "
            "--sft-num-preprocess-workers 16 --no-check-for-nan-in-loss-and-grad --training-phase sft "
            "--seq-length 4096 --max-position-embeddings 40960 --micro-batch-size 1 --global-batch-size 128 "
            "--lr 1.0e-5 --min-lr 1.0e-6 --clip-grad 1.0 --weight-decay 0.1 --optimizer adam --adam-beta1 0.9 "
            "--adam-beta2 0.95 --adam-eps 1e-08 --norm-epsilon 1e-6 --train-iters 5000 --lr-decay-iters 5000 "
            f"--lr-decay-style cosine --lr-warmup-fraction 0.002 --bf16 --load {ckpt.parent / 'hf'} "
            f"--save {ckpt} --save-interval 500 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 "
            "--sequence-parallel --use-distributed-optimizer --distributed-backend nccl --log-interval 1 "
            f"--tensorboard-dir {tb}").split()  # fmt: skip


def qwen3_moe_pretrain(data, ckpt, tb) -> list[str]:
    return (f"--model-name qwen3-30b-a3b --tokenizer-type HFTokenizer --hf-tokenizer-path /models/Qwen3-30B-A3B "
            f"--data-path {data} --split 949,50,1 --training-phase pretrain --seq-length 4096 "
            "--max-position-embeddings 40960 --micro-batch-size 1 --global-batch-size 512 --lr 3e-4 --min-lr 3e-5 "
            "--weight-decay 0.1 --train-iters 1000 --lr-decay-iters 1000 --lr-decay-style cosine "
            "--lr-warmup-iters 50 --bf16 --expert-model-parallel-size 8 --expert-tensor-parallel-size 1 "
            "--moe-router-topk 8 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3 "
            "--moe-token-dispatcher-type alltoall --moe-grouped-gemm --moe-router-dtype fp32 "
            "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 "
            "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 --use-distributed-optimizer "
            f"--distributed-backend nccl --save {ckpt} --save-interval 200 --seed 42 --attention-backend flash "
            f"--tensorboard-dir {tb}").split()  # fmt: skip


def hydra_qwen25(data, ckpt, tb) -> list[str]:
    return ["model=qwen2.5-0.5b", "phase=pretrain", "model.foundation.rotary_base=1000000",
            "data.tokenizer=/models/Qwen2.5-0.5B", f"data.sources=[{data}]", "data.val_fraction=0.01",
            "data.seq_length=4096", "model.foundation.max_position_embeddings=32768",
            "+model.foundation.init_method_std=0.006", "train.micro_batch_size=4", "train.global_batch_size=1024",
            "optim.lr=1e-5", "optim.min_lr=1e-6", "optim.clip_grad=1.0", "optim.weight_decay=0.1",
            "optim.beta1=0.9", "optim.beta2=0.95", "optim.eps=1e-8", "model.foundation.norm_epsilon=1e-6",
            "train.steps=50000", "optim.schedule=cosine", "optim.warmup_steps=100", "train.dtype=bf16",
            "resume=true", f"train.output_dir={ckpt}", "train.save_interval=5000", "train.eval_interval=1000",
            "train.eval_iters=10", "parallel.tp=1", "parallel.pp=1", "parallel.distributed_optimizer=true",
            "parallel.overlap_grad_reduce=true", "parallel.overlap_param_gather=true", "train.log_interval=1",
            "train.tensorboard=true"]  # fmt: skip


def hydra_qwen3_sft(data, ckpt, tb) -> list[str]:
    return ["model=qwen3-0.6b", "phase=sft", "model.foundation.rotary_base=1000000",
            "data.tokenizer=/models/Qwen3-0.6B", f"data.sources=[{data}]", "train.eval_iters=0",
            "train.eval_interval=0", "data.kind=chat", "data.seq_length=4096",
            "model.foundation.max_position_embeddings=40960", "train.micro_batch_size=1",
            "train.global_batch_size=128", "optim.lr=1e-5", "optim.min_lr=1e-6", "optim.weight_decay=0.1",
            "optim.eps=1e-8", "model.foundation.norm_epsilon=1e-6", "train.steps=5000", "optim.warmup_steps=10",
            "train.dtype=bf16", f"train.init_from={ckpt.parent / 'hf'}", f"train.output_dir={ckpt}",
            "train.save_interval=500", "parallel.tp=2", "parallel.sequence_parallel=true",
            "parallel.distributed_optimizer=true", "train.log_interval=1", "train.tensorboard=true"]  # fmt: skip


def hydra_qwen3_moe(data, ckpt, tb) -> list[str]:
    return ["model=qwen3-30b-a3b", "data.tokenizer=/models/Qwen3-30B-A3B", f"data.sources=[{data}]",
            "data.val_fraction=0.05", "data.seq_length=4096", "model.foundation.max_position_embeddings=40960",
            "train.micro_batch_size=1", "train.global_batch_size=512", "optim.lr=3e-4", "optim.min_lr=3e-5",
            "train.steps=1000", "optim.warmup_steps=50", "train.dtype=bf16", "parallel.ep=8", "parallel.etp=1",
            "model.foundation.moe.aux_loss_coeff=0.001", "+model.foundation.recompute=full", "parallel.pp=4",
            "parallel.distributed_optimizer=true", f"train.output_dir={ckpt}", "train.save_interval=200",
            "train.seed=42", "train.tensorboard=true"]  # fmt: skip


@pytest.mark.parametrize(
    ("megatron", "hydra"),
    [(qwen25_pretrain, hydra_qwen25), (qwen3_sft, hydra_qwen3_sft), (qwen3_moe_pretrain, hydra_qwen3_moe)],
    ids=["qwen2.5-0.5b-pretrain", "qwen3-sft", "qwen3-30b-a3b-moe-pretrain"],
)
def test_a_loongforge_launch_line_resolves_to_the_hand_written_hydra_config(tmp_path, megatron, hydra):
    paths = _script_paths(tmp_path)
    translated = translate(megatron(*paths))
    assert resolved(translated.overrides) == resolved(hydra(*paths))
    assert resolved(translated.overrides) != resolved([hydra(*paths)[0]])  # the flags did change something
    assert any("--tensorboard-dir ignored" in w for w in translated.warnings)


def test_the_sft_line_sets_the_learning_rate_over_the_phase_default(tmp_path):
    cfg = resolved(translate(qwen3_sft(*_script_paths(tmp_path))).overrides)
    assert (cfg.optim.lr, cfg.data.kind, cfg.parallel.tp) == (1e-5, "chat", 2)


# Every flag of ARG_MAP: (argv, the overrides it gives) or (argv, an error / warning it gives).
def _cases(tmp) -> dict[str, tuple[list[str], list[str] | str]]:
    hf = tmp / "hf"
    hf.mkdir(exist_ok=True)
    (hf / "config.json").write_text("{}")
    data = tmp / "c.txt"
    data.write_text("x")
    wb = "error: Weights & Biases logging is not supported; use TensorBoard"
    return {
        "--weight-decay": (["--weight-decay", "0.01"], ["optim.weight_decay=0.01"]),
        "--training-phase": (["--training-phase", "sft"], ["phase=sft"]),
        "--train-iters": (["--train-iters", "7"], ["train.steps=7"]),
        "--tokenizer-type": (["--tokenizer-type", "GPT2BPETokenizer"], "error: --tokenizer-type GPT2BPETokenizer is not supported"),  # fmt: skip
        "--seq-length": (["--seq-length", "128"], ["data.seq_length=128"]),
        "--min-lr": (["--min-lr", "1e-6"], ["optim.min_lr=1e-06"]),
        "--micro-batch-size": (["--micro-batch-size", "3"], ["train.micro_batch_size=3"]),
        "--max-position-embeddings": (["--max-position-embeddings", "512"], ["model.foundation.max_position_embeddings=512"]),  # fmt: skip
        "--lr-decay-style": (["--lr-decay-style", "WSD"], "error: --lr-decay-style WSD is not supported (allowed: cosine, linear, constant)"),  # fmt: skip
        "--lr": (["--lr", "0.001"], ["optim.lr=0.001"]),
        "--log-interval": (["--log-interval", "10"], ["train.log_interval=10"]),
        "--global-batch-size": (["--global-batch-size", "64"], ["train.global_batch_size=64"]),
        "--data-path": (["--data-path", "0.3", str(data)], "error: --data-path: weighted blends"),
        "--clip-grad": (["--clip-grad", "0.5"], ["optim.clip_grad=0.5"]),
        "--use-distributed-optimizer": (["--use-distributed-optimizer"], ["parallel.distributed_optimizer=true"]),
        "--tensorboard-dir": (["--tensorboard-dir", "/tb"], "warn: --tensorboard-dir ignored"),
        "--tensor-model-parallel-size": (["--tensor-model-parallel-size", "2"], ["parallel.tp=2"]),
        "--save-interval": (["--save-interval", "100"], ["train.save_interval=100"]),
        "--pipeline-model-parallel-size": (["--pipeline-model-parallel-size", "2"], ["parallel.pp=2"]),
        "--log-timers-to-tensorboard": (["--log-timers-to-tensorboard"], []),
        "--init-method-std": (["--init-method-std", "0.01"], ["model.foundation.init_method_std=0.01"]),
        "--hf-tokenizer-path": (["--hf-tokenizer-path", "/tok dir"], ["data.tokenizer='/tok dir'"]),
        "--split": (["--split", "98,2,0"], ["data.val_fraction=0.02"]),
        "--load": (["--load", str(hf)], [f"train.init_from={hf}"]),
        "--norm-epsilon": (["--norm-epsilon", "1e-6"], ["model.foundation.norm_epsilon=1e-06"]),
        "--bf16": (["--bf16"], ["train.dtype=bf16"]),
        "--lr-warmup-fraction": (["--train-iters", "1000", "--lr-warmup-fraction", "0.01"], ["train.steps=1000", "optim.warmup_steps=10"]),  # fmt: skip
        "--save": (["--save", "/runs/a"], ["train.output_dir=/runs/a"]),
        "--lr-decay-iters": (["--train-iters", "10", "--lr-decay-iters", "20"], "error: --lr-decay-iters 20 must equal --train-iters 10"),  # fmt: skip
        "--optimizer": (["--optimizer", "sgd"], "error: --optimizer sgd is not supported"),
        "--distributed-backend": (["--distributed-backend", "mpi"], "error: --distributed-backend mpi: no installed accelerator uses it"),  # fmt: skip
        "--adam-eps": (["--adam-eps", "1e-6"], ["optim.eps=1e-06"]),
        "--adam-beta2": (["--adam-beta2", "0.999"], ["optim.beta2=0.999"]),
        "--adam-beta1": (["--adam-beta1", "0.8"], ["optim.beta1=0.8"]),
        "--overlap-param-gather": (["--overlap-param-gather"], ["parallel.overlap_param_gather=true"]),
        "--overlap-grad-reduce": (["--overlap-grad-reduce"], ["parallel.overlap_grad_reduce=true"]),
        "--wandb-project": (["--wandb-project", "p"], wb.replace("error:", "error: --wandb-project is not supported:")),  # fmt: skip
        "--wandb-exp-name": (["--wandb-exp-name", "e"], wb.replace("error:", "error: --wandb-exp-name is not supported:")),  # fmt: skip
        "--eval-iters": (["--eval-iters", "5"], ["train.eval_iters=5"]),
        "--eval-interval": (["--eval-interval", "100"], ["train.eval_interval=100"]),
        "--model-name": (["--model-name", "qwen9-1t"], "error: --model-name qwen9-1t: not in Loong's model zoo"),
        "--rotary-base": (["--rotary-base", "500000"], ["model.foundation.rotary_base=500000.0"]),
        "--initial-loss-scale": (["--initial-loss-scale", "4096"], "warn: --initial-loss-scale ignored"),
        "--chat-template": (["--chat-template", "qwen"], ["data.kind=chat"]),
        "--sequence-parallel": (["--sequence-parallel"], ["parallel.sequence_parallel=true"]),
        **_cases_beyond_the_top_45(),
    }


def _cases_beyond_the_top_45() -> dict[str, tuple[list[str], list[str] | str]]:
    return {
        "--fp16": (["--fp16"], "error: --fp16 is not supported: Loong trains bf16 or fp32 (no fp16 loss scaling); use --bf16"),
        "--lr-warmup-iters": (["--lr-warmup-iters", "5"], ["optim.warmup_steps=5"]),
        "--seed": (["--seed", "3"], ["train.seed=3"]),
        "--tokenizer-model": (["--tokenizer-model", "/tok"], ["data.tokenizer=/tok"]),
        "--eod-mask-loss": (["--eod-mask-loss"], []),
        "--rotary-seq-len-interpolation-factor": (["--rotary-seq-len-interpolation-factor", "4"], "error: --rotary-seq-len-interpolation-factor 4.0: only 1"),  # fmt: skip
        "--sft-num-preprocess-workers": (["--sft-num-preprocess-workers", "8"], "warn: --sft-num-preprocess-workers ignored"),  # fmt: skip
        "--num-workers": (["--num-workers", "8"], "warn: --num-workers ignored"),
        "--dataloader-type": (["--dataloader-type", "cyclic"], "warn: --dataloader-type ignored"),
        "--no-check-for-nan-in-loss-and-grad": (["--no-check-for-nan-in-loss-and-grad"], "warn: --no-check-for-nan-in-loss-and-grad ignored"),  # fmt: skip
        "--packing-sft-data": (["--packing-sft-data"], "error: --packing-sft-data is not supported"),
        "--no-load-optim": (["--no-load-optim"], "error: --no-load-optim is not supported: a resume restores the optimizer; use train.init_from"),  # fmt: skip
        "--no-load-rng": (["--no-load-rng"], "error: --no-load-rng is not supported"),
        "--ckpt-format": (["--ckpt-format", "torch"], "error: --ckpt-format torch is not supported"),
        "--context-parallel-size": (["--context-parallel-size", "2"], "error: --context-parallel-size is not supported"),  # fmt: skip
        "--fp8-format": (["--fp8-format", "hybrid"], "error: --fp8-format is not supported"),
        "--recompute-granularity": (["--recompute-granularity", "selective"], ["model.foundation.recompute=selective"]),  # fmt: skip
        "--recompute-method": (["--recompute-method", "uniform"], "warn: --recompute-method ignored"),
        "--recompute-num-layers": (["--recompute-num-layers", "1"], "warn: --recompute-num-layers ignored"),
        "--num-layers": (["--num-layers", "4"], ["model.foundation.num_layers=4"]),
        "--hidden-size": (["--hidden-size", "96"], ["model.foundation.hidden_size=96"]),
        "--ffn-hidden-size": (["--ffn-hidden-size", "256"], ["model.foundation.ffn_hidden_size=256"]),
        "--num-attention-heads": (["--num-attention-heads", "8"], ["model.foundation.num_attention_heads=8"]),
        "--kv-channels": (["--kv-channels", "16"], ["model.foundation.kv_channels=16"]),
        "--group-query-attention": (["--group-query-attention"], []),
        "--num-query-groups": (["--num-query-groups", "2"], ["model.foundation.num_query_groups=2"]),
        "--swiglu": (["--swiglu"], []),
        "--normalization": (["--normalization", "LayerNorm"], "error: --normalization LayerNorm"),
        "--untie-embeddings-and-output-weights": (["--untie-embeddings-and-output-weights"], ["model.foundation.tie_word_embeddings=false"]),  # fmt: skip
        "--disable-bias-linear": (["--disable-bias-linear"], []),
        "--add-qkv-bias": (["--add-qkv-bias"], []),
        "--qk-layernorm": (["--qk-layernorm"], []),
        "--position-embedding-type": (["--position-embedding-type", "learned_absolute"], "error: --position-embedding-type learned_absolute"),  # fmt: skip
        "--use-rotary-position-embeddings": (["--use-rotary-position-embeddings"], []),
        "--use-mcore-models": (["--use-mcore-models"], []),
        "--use-flash-attn": (["--use-flash-attn"], []),
        "--transformer-impl": (["--transformer-impl", "local"], ["model.layer_backend=local"]),
        "--vocab-size": (["--vocab-size", "1000"], ["model.foundation.vocab_size=1000"]),
        "--make-vocab-size-divisible-by": (["--make-vocab-size-divisible-by", "64"], ["model.foundation.make_vocab_size_divisible_by=64"]),  # fmt: skip
        "--num-experts": (["--num-experts", "16"], ["model.foundation.moe.num_experts=16"]),
        "--moe-router-topk": (["--moe-router-topk", "4"], ["model.foundation.moe.router_topk=4"]),
        "--moe-ffn-hidden-size": (["--moe-ffn-hidden-size", "64"], ["model.foundation.moe.ffn_hidden_size=64"]),
        "--moe-router-load-balancing-type": (["--moe-router-load-balancing-type", "seq_aux_loss"], ["model.foundation.moe.load_balancing=seq_aux_loss"]),  # fmt: skip
        "--moe-aux-loss-coeff": (["--moe-aux-loss-coeff", "0.01"], ["model.foundation.moe.aux_loss_coeff=0.01"]),
        "--moe-router-dtype": (["--moe-router-dtype", "fp64"], ["model.foundation.moe.router_dtype=fp64"]),
        "--moe-grouped-gemm": (["--moe-grouped-gemm"], []),
        "--moe-token-dispatcher-type": (["--moe-token-dispatcher-type", "allgather"], ["parallel.moe_token_dispatcher=allgather"]),  # fmt: skip
        "--expert-model-parallel-size": (["--expert-model-parallel-size", "4"], ["parallel.ep=4"]),
        "--expert-tensor-parallel-size": (["--expert-tensor-parallel-size", "1"], ["parallel.etp=1"]),
        "--attention-backend": (["--attention-backend", "flash"], "warn: --attention-backend ignored"),
        "--empty-unused-memory-level": (["--empty-unused-memory-level", "1"], "warn: --empty-unused-memory-level ignored"),  # fmt: skip
        "--use-precision-aware-optimizer": (["--use-precision-aware-optimizer"], ["optim.precision_aware=true"]),
        "--optimizer-cpu-offload": (["--optimizer-cpu-offload"], ["optim.offload_fraction=1.0"]),
        "--optimizer-offload-fraction": (["--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.4"], ["optim.offload_fraction=0.4"]),  # fmt: skip
        "--calculate-per-token-loss": (["--calculate-per-token-loss"], []),
        "--config-file": (["--config-file", "x.yaml"], "error: --config-file is not supported"),
        "--custom-pipeline-layers": (["--custom-pipeline-layers", "3,5"], "error: --custom-pipeline-layers is not supported"),  # fmt: skip
        "--save-hf": (["--save-hf"], ["train.export_hf=true"]),
    }


def test_every_flag_of_the_table_has_a_case_below(tmp_path):
    assert set(_cases(tmp_path)) == set(ARG_MAP)
    assert len(ARG_MAP) >= 45


@pytest.mark.parametrize("flag", sorted(ARG_MAP))
def test_each_table_flag_maps_warns_or_errors_as_declared(tmp_path, flag):
    argv, expected = _cases(tmp_path)[flag]
    if isinstance(expected, list):
        assert [o.removeprefix("++") for o in translate(argv).overrides] == expected
    elif expected.startswith("warn: "):
        assert any(w.startswith(expected[6:]) for w in translate(argv).warnings)
    else:
        with pytest.raises(MegatronArgError) as e:
            translate(argv)
        assert str(e.value).startswith(expected[7:])


def test_a_misspelled_flag_fails_naming_the_nearest_one():
    with pytest.raises(MegatronArgError, match=r"^unknown Megatron argument --micro-batch-szie; did you mean --micro-batch-size\?$"):  # fmt: skip
        translate(["--micro-batch-szie", "2"])


def test_a_megatron_prefix_as_data_path_is_refused_naming_data_sources(tmp_path):
    (tmp_path / "pile_text_document.bin").write_bytes(b"")
    with pytest.raises(MegatronArgError, match="Megatron .bin/.idx prefixes are not supported; use data.sources"):
        translate(["--data-path", str(tmp_path / "pile_text_document")])


def test_values_of_the_wrong_type_and_stray_words_fail_naming_the_flag():
    with pytest.raises(MegatronArgError, match="--micro-batch-size expects int, got 'four'"):
        translate(["--micro-batch-size", "four"])
    with pytest.raises(MegatronArgError, match="unexpected argument 'qwen'"):
        translate(["--bf16", "qwen"])


def test_hydra_overrides_after_the_flags_come_last_and_win():
    out = translate(["--lr", "0.1", "optim.lr=0.2", "--bf16"]).overrides
    assert out == ["++optim.lr=0.1", "++train.dtype=bf16", "optim.lr=0.2"]
    assert resolved(out).optim.lr == 0.2


def test_train_megatron_print_overrides_prints_them_and_a_typo_exits_non_zero(tmp_path):
    cmd = [sys.executable, "-m", "loong_train", "--megatron"]
    env = launch_env()
    ok = subprocess.run([*cmd, "--print-overrides", "--", "--lr", "1e-3", "--bf16"], capture_output=True, text=True, env=env)  # fmt: skip
    assert (ok.returncode, ok.stdout.strip()) == (0, "++optim.lr=0.001 ++train.dtype=bf16")
    bad = subprocess.run([*cmd, "--", "--micro-batch-szie", "2"], capture_output=True, text=True, env=env)
    assert bad.returncode != 0
    assert "unknown Megatron argument --micro-batch-szie; did you mean --micro-batch-size?" in bad.stderr


# The tiny model of TINY, as Megatron flags.
TINY_MEGATRON = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "16", "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "8", "--eval-iters", "1", "--lr-warmup-iters", "2", "--train-iters", "10", "--lr", "0.002", "--min-lr", "0.0002", "--lr-decay-style", "cosine", "--lr-decay-iters", "10", "--weight-decay", "0.1", "--clip-grad", "1.0", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--optimizer", "adam", "--distributed-backend", "gloo", "--log-interval", "1", "--eval-interval", "5", "--seed", "7"]  # fmt: skip


def test_ten_cpu_steps_through_megatron_flags_give_the_hydra_runs_losses_bit_for_bit(run_train, tmp_path, data_cache):
    hydra = run_train(["train.steps=10", "optim.lr=0.002", "optim.min_lr=0.0002", "train.eval_interval=5",
                       "train.seed=7"], name="hydra").check()  # fmt: skip
    out = tmp_path / "megatron"
    argv = ["--megatron", "--", *TINY_MEGATRON, "--save", str(out), f"data.cache_dir={data_cache}",
            "train.tensorboard=false", "train.progress=false"]  # fmt: skip
    proc = subprocess.run(train_command(argv), cwd=tmp_path, env=launch_env(), capture_output=True, text=True)
    megatron = Run(proc.returncode, proc.stdout, proc.stderr, out).check()
    assert len(hydra.losses()) == 10
    assert megatron.losses() == hydra.losses()
