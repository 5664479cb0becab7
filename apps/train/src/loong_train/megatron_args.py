"""Megatron-LM / LoongForge launch flags -> Loong's Hydra overrides, from one declarative table.

``uv run train --megatron -- <megatron flags> [hydra overrides]`` runs an existing launch script's
flags; ``train --megatron --print-overrides -- ...`` prints the overrides instead, to migrate.
Every flag in ``ARG_MAP`` is either mapped to a Loong key, accepted (Loong does it anyway),
ignored with a warning, or refused naming the Loong key or flag to use. A flag that is not in the
table fails naming the nearest one: nothing falls through to Hydra's confusing errors.
Flags that a script does not give keep Loong's defaults (not Megatron's).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path

Pairs = list[tuple[str, object]]  # (Loong key, value) in the order they are emitted


class MegatronArgError(ValueError):
    """A Megatron flag that Loong cannot run; the message names the flag and what to use."""


@dataclass(frozen=True)
class Arg:
    """One table entry. kind: key (value -> ``key``), switch (flag -> ``key=value``), accept,
    warn (ignored with a warning), error (refused, with ``alternative``), custom (``fn``)."""

    kind: str
    key: str = ""
    nargs: int | str = 1  # 0: a switch; 1: one value; "+": one or more values
    type: Callable = str
    value: object = True  # what a switch sets
    reason: str = ""
    alternative: str = ""
    fn: Callable[[object, dict], Pairs] | None = None
    sets: tuple[tuple[str, object], ...] = ()  # what an accepted / warned flag still sets


def key(path: str, type: Callable = str) -> Arg:
    return Arg("key", key=path, type=type)


def switch(path: str, value: object = True) -> Arg:
    return Arg("switch", key=path, nargs=0, value=value)


def accept(reason: str, nargs: int | str = 0) -> Arg:
    return Arg("accept", nargs=nargs, reason=reason)


def warn(reason: str, nargs: int | str = 1, sets: tuple = ()) -> Arg:
    return Arg("warn", nargs=nargs, reason=reason, sets=sets)


def error(reason: str, alternative: str, nargs: int | str = 1) -> Arg:
    return Arg("error", nargs=nargs, reason=reason, alternative=alternative)


def custom(fn: Callable[[object, dict], Pairs], nargs: int | str = 1, type: Callable = str) -> Arg:
    return Arg("custom", nargs=nargs, type=type, fn=fn)


@dataclass
class Translation:
    overrides: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


# ---- the flags whose meaning depends on their value or on other flags -------------------------


def _choice(flag: str, allowed: dict[str, Pairs], alternative: str) -> Callable[[object, dict], Pairs]:
    def fn(value: object, args: dict) -> Pairs:
        if value not in allowed:
            raise MegatronArgError(f"{flag} {value} is not supported (allowed: {', '.join(allowed)}); "
                                   f"use {alternative}")  # fmt: skip
        return allowed[value]

    return fn


def _model_name(value: object, args: dict) -> Pairs:
    spec = find_spec("loong_models")  # the zoo's YAML files, without importing megatron-core
    zoo = sorted(p.stem for p in (Path(spec.origin).parent / "configs" / "model").glob("*.yaml"))
    name = str(value).lower()
    if name not in zoo:
        raise MegatronArgError(f"--model-name {value}: not in Loong's model zoo; use model=<name> "
                               f"with one of: {', '.join(zoo)}")  # fmt: skip
    return [("model", name)]


def _tokenizer_type(value: object, args: dict) -> Pairs:
    if value == "HFTokenizer":
        if "--hf-tokenizer-path" not in args and "--tokenizer-model" not in args:
            raise MegatronArgError(
                "--tokenizer-type HFTokenizer needs --hf-tokenizer-path (Loong key data.tokenizer)"
            )
        return []
    raise MegatronArgError(f"--tokenizer-type {value} is not supported: Loong reads HF tokenizers only; "
                           "use --tokenizer-type HFTokenizer --hf-tokenizer-path <dir> (data.tokenizer)")  # fmt: skip


def _data_path(values: object, args: dict) -> Pairs:
    sources = []
    for v in values:
        if re.fullmatch(r"[0-9.eE+-]+", v):
            raise MegatronArgError(f"--data-path: weighted blends ({v} ...) are not supported; "
                                   "use data.sources=[...] (files or folders, sampled by size)")  # fmt: skip
        p = Path(v)
        if not p.exists() and (Path(v + ".bin").exists() or Path(v + ".idx").exists() or not p.suffix):
            raise MegatronArgError(f"--data-path {v}: Megatron .bin/.idx prefixes are not supported; "
                                   "use data.sources=[<.txt/.jsonl files or folders>] (loong-data tokenises them)")  # fmt: skip
        sources.append(v)
    return [("data.sources", sources)]


def _split(value: object, args: dict) -> Pairs:
    try:
        parts = [float(x) for x in re.split(r"[,/]", str(value))]
    except ValueError:
        parts = []
    if len(parts) != 3 or min(parts) < 0 or sum(parts) <= 0:
        raise MegatronArgError(f"--split {value}: expected three weights 'train,valid,test' (e.g. 99,1,0)")
    if parts[1] == 0:  # Megatron evaluates nothing; Loong's eval needs a validation share
        return [("train.eval_iters", 0), ("train.eval_interval", 0)]
    return [("data.val_fraction", parts[1] / sum(parts))]


def _warmup_fraction(value: object, args: dict) -> Pairs:
    if "--train-iters" not in args:
        raise MegatronArgError("--lr-warmup-fraction needs --train-iters (Loong key optim.warmup_steps)")
    return [("optim.warmup_steps", round(value * args["--train-iters"]))]


def _cpu_offload(value: object, args: dict) -> Pairs:
    # megatron-LM's --optimizer-offload-fraction defaults to 1.0 (all of the state on the host)
    return [("optim.offload_fraction", args.get("--optimizer-offload-fraction", 1.0))]


def _decay_iters(value: object, args: dict) -> Pairs:
    if value != args.get("--train-iters"):
        raise MegatronArgError(f"--lr-decay-iters {value} must equal --train-iters {args.get('--train-iters')}: "
                               "Loong decays the learning rate over train.steps")  # fmt: skip
    return []


def _load(value: object, args: dict) -> Pairs:
    path = Path(str(value))
    if (path / "config.json").is_file():  # an HF model directory: its weights, not a resume
        return [("train.init_from", str(value))]
    if (path / "meta.json").is_file() or path.name.startswith("step_"):
        return [("train.init_from", str(value))]  # one Loong checkpoint: its weights
    if args.get("--save") is not None and Path(str(args["--save"])) == path:
        return [("resume", True)]  # Megatron's --load X --save X: continue the run in X
    raise MegatronArgError(f"--load {value}: neither an HF model directory, a Loong checkpoint (step_*), "
                           "nor the --save directory; use train.init_from=<dir> or --save <same dir> to resume")  # fmt: skip


def _distributed_backend(value: object, args: dict) -> Pairs:
    from loong_xpu.registry import backend_names, load_backend  # the installed accelerators

    backends = {load_backend(n).dist_backend: n for n in backend_names()}
    if value not in backends:
        raise MegatronArgError(f"--distributed-backend {value}: no installed accelerator uses it (known: "
                               f"{', '.join(sorted(backends))}); Loong takes it from train.device / LOONG_DEVICE")  # fmt: skip
    return []


def _interpolation(value: object, args: dict) -> Pairs:
    if value != 1:
        raise MegatronArgError(f"--rotary-seq-len-interpolation-factor {value}: only 1 (none) is supported; "
                               "use model.foundation.rope_scaling (llama3 scaling)")  # fmt: skip
    return []


def _normalization(value: object, args: dict) -> Pairs:
    if value != "RMSNorm":
        raise MegatronArgError(f"--normalization {value}: Loong's families use RMSNorm; "
                               "pick a family with model.foundation.family")  # fmt: skip
    return []


def _chat_template(value: object, args: dict) -> Pairs:
    return [("data.kind", "chat")]


_SCHEDULES = {s: [("optim.schedule", s)] for s in ("cosine", "linear", "constant")}
_RECOMPUTE = {g: [("model.foundation.recompute", g)] for g in ("full", "selective")}
_PHASES = {p: [("phase", p)] for p in ("pretrain", "sft")}

# Megatron-LM (MLM) and LoongForge (LF) flags. The first 45 are the most used in LoongForge's
# launch scripts (NEXT_WAVE.md §7), the rest the architecture and MoE flags that ride on them.
ARG_MAP: dict[str, Arg] = {
    "--weight-decay": key("optim.weight_decay", float),
    "--training-phase": custom(_choice("--training-phase", _PHASES, "phase=<name>")),
    "--train-iters": key("train.steps", int),
    "--tokenizer-type": custom(_tokenizer_type),
    "--seq-length": key("data.seq_length", int),
    "--min-lr": key("optim.min_lr", float),
    "--micro-batch-size": key("train.micro_batch_size", int),
    "--max-position-embeddings": key("model.foundation.max_position_embeddings", int),
    "--lr-decay-style": custom(_choice("--lr-decay-style", _SCHEDULES, "optim.schedule")),
    "--lr": key("optim.lr", float),
    "--log-interval": key("train.log_interval", int),
    "--global-batch-size": key("train.global_batch_size", int),
    "--data-path": custom(_data_path, nargs="+"),
    "--clip-grad": key("optim.clip_grad", float),
    "--use-distributed-optimizer": switch("parallel.distributed_optimizer"),
    "--tensorboard-dir": warn(
        "Loong writes TensorBoard logs to <train.output_dir>/tensorboard", sets=(("train.tensorboard", True),)
    ),  # fmt: skip
    "--tensor-model-parallel-size": key("parallel.tp", int),
    "--save-interval": key("train.save_interval", int),
    "--pipeline-model-parallel-size": key("parallel.pp", int),
    "--log-timers-to-tensorboard": accept("Loong always logs step times"),
    "--init-method-std": key("model.foundation.init_method_std", float),
    "--hf-tokenizer-path": key("data.tokenizer"),
    "--split": custom(_split),
    "--load": custom(_load),
    "--norm-epsilon": key("model.foundation.norm_epsilon", float),
    "--bf16": switch("train.dtype", "bf16"),
    "--lr-warmup-fraction": custom(_warmup_fraction, type=float),
    "--save": key("train.output_dir"),
    "--lr-decay-iters": custom(_decay_iters, type=int),
    "--optimizer": custom(_choice("--optimizer", {"adam": []}, "the default AdamW (optim.*)")),
    "--distributed-backend": custom(_distributed_backend),
    "--adam-eps": key("optim.eps", float),
    "--adam-beta2": key("optim.beta2", float),
    "--adam-beta1": key("optim.beta1", float),
    "--overlap-param-gather": switch("parallel.overlap_param_gather"),
    "--overlap-grad-reduce": switch("parallel.overlap_grad_reduce"),
    "--wandb-project": error(
        "Weights & Biases logging is not supported", "TensorBoard (train.tensorboard=true)"
    ),
    "--wandb-exp-name": error(
        "Weights & Biases logging is not supported", "TensorBoard (train.tensorboard=true)"
    ),
    "--eval-iters": key("train.eval_iters", int),
    "--eval-interval": key("train.eval_interval", int),
    "--model-name": custom(_model_name),
    "--rotary-base": key("model.foundation.rotary_base", float),
    "--initial-loss-scale": warn("loss scaling only applies to fp16; Loong trains bf16/fp32 without it"),
    "--chat-template": custom(_chat_template),
    "--sequence-parallel": switch("parallel.sequence_parallel"),
    # -- precision, schedule, data, checkpoints
    "--fp16": error("Loong trains bf16 or fp32 (no fp16 loss scaling)", "--bf16 (train.dtype=bf16)", nargs=0),
    "--lr-warmup-iters": key("optim.warmup_steps", int),
    "--seed": key("train.seed", int),
    "--tokenizer-model": key("data.tokenizer"),
    "--eod-mask-loss": accept("Loong masks nothing but padding and (chat) non-assistant tokens"),
    "--rotary-seq-len-interpolation-factor": custom(_interpolation, type=float),
    "--sft-num-preprocess-workers": warn("loong-data tokenises with its own worker count"),
    "--num-workers": warn("loong-data's loader needs no worker processes"),
    "--dataloader-type": warn("Loong's sampler is always the resumable cyclic one"),
    "--no-check-for-nan-in-loss-and-grad": warn("Loong always stops on a non-finite loss", nargs=0),
    "--packing-sft-data": error(
        "chat data trains one conversation per row",
        "data.kind=text data.packing=thd for packed documents",
        nargs=0,
    ),  # fmt: skip
    "--no-load-optim": error(
        "a resume restores the optimizer", "train.init_from=<checkpoint> (weights only)", 0
    ),
    "--no-load-rng": error(
        "a resume restores the RNG state", "train.init_from=<checkpoint> (weights only)", 0
    ),
    "--ckpt-format": custom(_choice("--ckpt-format", {"torch_dist": []}, "the default (torch_dist)")),
    "--context-parallel-size": error("context parallelism is not available yet", "parallel.tp / parallel.pp"),
    "--fp8-format": error("FP8 is set per component", "model.foundation.precision.fp8=on and .recipe"),
    "--recompute-granularity": custom(
        _choice("--recompute-granularity", _RECOMPUTE, "model.foundation.recompute")
    ),
    "--recompute-method": warn("megatron's uniform full recompute of every layer is what Loong does"),
    "--recompute-num-layers": warn("Loong recomputes every layer (model.foundation.recompute=full)"),
    # -- architecture, on top of --model-name (as in LoongForge)
    "--num-layers": key("model.foundation.num_layers", int),
    "--hidden-size": key("model.foundation.hidden_size", int),
    "--ffn-hidden-size": key("model.foundation.ffn_hidden_size", int),
    "--num-attention-heads": key("model.foundation.num_attention_heads", int),
    "--kv-channels": key("model.foundation.kv_channels", int),
    "--group-query-attention": accept("the KV heads come from --num-query-groups"),
    "--num-query-groups": key("model.foundation.num_query_groups", int),
    "--swiglu": accept("Loong's families use SwiGLU"),
    "--normalization": custom(_normalization),
    "--untie-embeddings-and-output-weights": switch("model.foundation.tie_word_embeddings", False),
    "--disable-bias-linear": accept("the family decides biases (model.foundation.family)"),
    "--add-qkv-bias": accept("the family decides biases (qwen2 has QKV biases)"),
    "--qk-layernorm": accept("the family decides QK norms (qwen3 has them)"),
    "--position-embedding-type": custom(_choice("--position-embedding-type", {"rope": []}, "a RoPE family")),
    "--use-rotary-position-embeddings": accept("Loong's families use RoPE"),
    "--use-mcore-models": accept("Loong builds megatron-core models"),
    "--use-flash-attn": accept("the layer backend picks the fastest attention"),
    "--transformer-impl": custom(
        _choice(
            "--transformer-impl",
            {
                "local": [("model.layer_backend", "local")],
                "transformer_engine": [("model.layer_backend", "te")],
            },
            "model.layer_backend",
        )
    ),  # fmt: skip
    "--vocab-size": key("model.foundation.vocab_size", int),
    "--make-vocab-size-divisible-by": key("model.foundation.make_vocab_size_divisible_by", int),
    # -- Mixture of Experts
    "--num-experts": key("model.foundation.moe.num_experts", int),
    "--moe-router-topk": key("model.foundation.moe.router_topk", int),
    "--moe-ffn-hidden-size": key("model.foundation.moe.ffn_hidden_size", int),
    "--moe-router-load-balancing-type": key("model.foundation.moe.load_balancing"),
    "--moe-aux-loss-coeff": key("model.foundation.moe.aux_loss_coeff", float),
    "--moe-router-dtype": key("model.foundation.moe.router_dtype"),
    "--moe-grouped-gemm": accept("the layer backend picks grouped-GEMM experts where it has them"),
    "--moe-token-dispatcher-type": key("parallel.moe_token_dispatcher"),
    "--expert-model-parallel-size": key("parallel.ep", int),
    "--expert-tensor-parallel-size": key("parallel.etp", int),
    # -- performance knobs Loong sets itself, and LoongForge-only flags
    "--attention-backend": warn("the layer backend (model.layer_backend) picks the attention kernel"),
    "--empty-unused-memory-level": warn("Loong does not empty the allocator cache between steps"),
    "--use-precision-aware-optimizer": switch("optim.precision_aware"),
    "--optimizer-cpu-offload": custom(_cpu_offload, nargs=0),
    # read by --optimizer-cpu-offload; without it megatron offloads nothing either
    "--optimizer-offload-fraction": custom(lambda value, args: [], type=float),
    "--calculate-per-token-loss": accept("Loong's loss is the mean over the tokens of the global batch"),
    "--config-file": error("model YAML files are Hydra configs in Loong", "model=<zoo name> or --model-name"),
    "--custom-pipeline-layers": error("Loong splits layers evenly over stages", "parallel.pp / parallel.vpp"),
    "--save-hf": switch("train.export_hf"),
}


# ---- parsing ----------------------------------------------------------------------------------


def _lookup(flag: str) -> Arg:
    if flag in ARG_MAP:
        return ARG_MAP[flag]
    near = difflib.get_close_matches(flag, ARG_MAP, n=1)
    hint = (
        f"; did you mean {near[0]}?"
        if near
        else "; the supported flags are loong_train.megatron_args.ARG_MAP"
    )
    raise MegatronArgError(f"unknown Megatron argument {flag}{hint}")


def _convert(flag: str, arg: Arg, raw: str) -> object:
    try:
        return arg.type(raw)
    except ValueError:
        raise MegatronArgError(
            f"{flag} expects {getattr(arg.type, '__name__', 'a value')}, got {raw!r}"
        ) from None


def _take_values(flag: str, arg: Arg, inline: str | None, rest: list[str]) -> tuple[object, list[str]]:
    if arg.nargs == 0:
        if inline is not None:
            raise MegatronArgError(f"{flag} takes no value (got {flag}={inline})")
        return True, rest
    if inline is not None:
        values, rest = [inline], rest
    else:
        n = 1
        if arg.nargs == "+":
            while n < len(rest) and not rest[n].startswith("--") and "=" not in rest[n]:
                n += 1
        values, rest = rest[:n], rest[n:]
        if not values or values[0].startswith("--"):
            raise MegatronArgError(f"{flag} expects a value")
    converted = [_convert(flag, arg, v) for v in values]
    return (converted if arg.nargs == "+" else converted[0]), rest


def parse(argv: list[str]) -> tuple[dict[str, object], list[str]]:
    """Split ``argv`` into Megatron flags (in order, the last occurrence wins) and the Hydra
    overrides (``key=value`` tokens) given after or between them."""
    flags: dict[str, object] = {}
    hydra: list[str] = []
    rest = list(argv)
    while rest:
        token, rest = rest[0], rest[1:]
        if not token.startswith("--"):
            if "=" not in token:
                raise MegatronArgError(
                    f"unexpected argument {token!r}: not a --flag, its value, or a key=value override"
                )
            hydra.append(token)
            continue
        flag, _, inline = token.partition("=")
        arg = _lookup(flag)
        flags[flag], rest = _take_values(flag, arg, inline if "=" in token else None, rest)
    return flags, hydra


def _apply(flag: str, value: object, flags: dict) -> tuple[Pairs, str | None]:
    arg = ARG_MAP[flag]
    if arg.kind == "key":
        return [(arg.key, value)], None
    if arg.kind == "switch":
        return [(arg.key, arg.value)], None
    if arg.kind == "accept":
        return [], None
    if arg.kind == "warn":
        return list(arg.sets), f"{flag} ignored: {arg.reason}"
    if arg.kind == "error":
        raise MegatronArgError(f"{flag} is not supported: {arg.reason}; use {arg.alternative}")
    return arg.fn(value, flags), None


_PLAIN = re.compile(r"[A-Za-z0-9_./:+-]+")


def _hydra_value(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ",".join(_hydra_value(v) for v in value) + "]"
    text = str(value)
    if _PLAIN.fullmatch(text):
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def translate(argv: list[str]) -> Translation:
    """Megatron-LM flags (plus trailing Hydra overrides) -> Loong's Hydra overrides. Group
    choices (``model=``, ``phase=``) come first, then ``++key=value`` (set or add), then the
    caller's own overrides, which win."""
    flags, hydra = parse(argv)
    out = Translation()
    pairs: Pairs = []
    for flag, value in flags.items():
        produced, warning = _apply(flag, value, flags)
        pairs += produced
        if warning:
            out.warnings.append(warning)
    groups = [(k, v) for k, v in pairs if k in ("model", "phase")]
    keys = {k: v for k, v in pairs if k not in ("model", "phase")}  # a later flag wins
    # ++: zoo YAML files leave many schema keys out; the schema still refuses unknown ones
    out.overrides = [f"{k}={_hydra_value(v)}" for k, v in groups]
    out.overrides += [f"++{k}={_hydra_value(v)}" for k, v in keys.items()] + hydra
    return out


def split_cli(argv: list[str]) -> tuple[list[str], bool] | None:
    """``train --megatron [--print-overrides] [--] <flags>`` -> (the flags, print only); None
    when ``argv`` is an ordinary Hydra command line."""
    if not argv or argv[0] != "--megatron":
        return None
    rest, print_only = argv[1:], False
    if rest[:1] == ["--print-overrides"]:
        rest, print_only = rest[1:], True
    if rest[:1] == ["--"]:
        rest = rest[1:]
    return rest, print_only


def hydra_argv(argv: list[str]) -> list[str]:
    """The ``train`` command line to hand to Hydra: ``argv`` itself, or the translation of a
    ``--megatron`` one (printed and exit with ``--print-overrides``; exit 2 naming a bad flag)."""
    import sys

    from loong_train.log import logger

    cli = split_cli(argv)
    if cli is None:
        return argv
    flags, print_only = cli
    try:
        result = translate(flags)
    except MegatronArgError as e:
        sys.exit(f"error: {e}")
    for warning in result.warnings:
        logger.warning("%s", warning)
    if print_only:
        print(" ".join(result.overrides))
        sys.exit(0)
    return result.overrides
