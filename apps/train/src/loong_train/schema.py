"""The train app's config schema. Hydra composes the YAML groups; this schema validates the result
before anything starts, so a bad key or value fails naming the key and what is allowed."""

from __future__ import annotations

from dataclasses import dataclass, field

from loong_ckpt.run_dir import SCHEDULE_CHOICES
from loong_models import ModelConfig
from loong_parallel import OptimConfig, ParallelConfig
from loong_train.multimodal_config import MultimodalDataConfig, validate_multimodal
from loong_train.packing_config import BalanceConfig, ThdConfig, validate_packing

DTYPES = ("auto", "bf16", "fp16", "fp32")


DATA_KINDS = ("text", "chat", "multimodal")


@dataclass
class DataConfig:
    # text: plain text corpora (pre-training); chat: JSONL conversations ({"messages": [...]}) through
    # a chat template, loss on the assistant's tokens only (SFT); sources [] = the bundled Shakespeare QA;
    # multimodal: conversations with images / videos (data.multimodal.*, multimodal.py)
    kind: str = "text"
    # .txt files / folders of .txt / .jsonl ({"text": ...}); empty = the bundled Shakespeare corpus
    sources: list[str] = field(default_factory=list)
    tokenizer: str | None = None  # tokenizer.json or an HF folder; None = the bundled BPE
    cache_dir: str = "runs/data-cache"  # tokenised corpora, reused across runs
    seq_length: int = 256
    val_fraction: float = 0.02
    # fixed: seq_length windows of the token stream; thd: variable-length document samples packed
    # into seq_length-token sequences with cu_seqlens (no attention across documents)
    packing: str = "fixed"
    thd: ThdConfig = field(default_factory=ThdConfig)
    balance: BalanceConfig = field(default_factory=BalanceConfig)
    multimodal: MultimodalDataConfig = field(default_factory=MultimodalDataConfig)


@dataclass
class TrainConfig:
    steps: int = 100  # 0: only initialise and save (a common starting point for several runs)
    micro_batch_size: int = 4
    global_batch_size: int = 16
    seed: int = 1234
    dtype: str = "auto"  # auto = the accelerator's preferred dtype (bf16 on GPU, fp32 on CPU)
    device: str = "auto"  # LOONG_DEVICE: auto | cuda | cpu | an installed plugin
    output_dir: str = "runs/default"
    log_interval: int = 1
    eval_interval: int = 50  # 0 = no periodic eval (a final eval still runs when eval_iters > 0)
    eval_iters: int = 4
    save_interval: int = 0  # 0 = save at the end only
    save_final: bool = True  # save a checkpoint when the run ends (benchmarks turn it off)
    keep_last: int = 2  # complete checkpoints kept (and always the newest one that verified)
    overwrite: bool = False  # a fresh run may replace another run's output in output_dir
    # resume=true with another train.steps / optim LR schedule: refuse, rescale (the schedule follows
    # the current config from the checkpoint's step on) or keep (the checkpoint's schedule)
    resume_schedule: str = "refuse"
    nonfinite_limit: int = 5  # steps in a row with a NaN / Inf loss or gradient (each skipped) before the run stops
    init_from: str | None = None  # model weights (not optimizer) from a checkpoint or an HF directory
    export_hf: bool = False  # write HF weights (output_dir/hf/step_N) at the end ...
    export_hf_interval: int = 0  # ... and every N steps (0 = only at the end)
    tensorboard: bool = True
    progress: bool = True


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    resume: bool = False  # continue from the newest complete checkpoint in train.output_dir


class ConfigError(ValueError):
    """A config key or value that cannot run; the message names the key."""


def validate(cfg: Config, world_size: int) -> int:
    """Check cross-field constraints; return the number of micro-batches per step."""
    t, f = cfg.train, cfg.model.foundation
    try:
        cfg.model.validate()  # every component (foundation, image encoder, projector, token ids)
        if cfg.model.lora is not None:
            cfg.model.lora.validate()
        cfg.optim.validate()
        moe = f.moe
        cfg.parallel.validate(
            world_size, f.num_layers, f.num_attention_heads, f.query_groups,
            num_experts=moe.num_experts if moe else None, expert_ffn_hidden_size=moe.ffn_hidden_size if moe else None,
            has_shared_experts=bool(moe and moe.shared_expert_intermediate_size),
        )  # fmt: skip
    except ValueError as e:
        raise ConfigError(str(e)) from None
    inside_moe = {"expert_fc1", "moe_act"} & set(cfg.parallel.offload_activations)
    if inside_moe and "moe" in (f.recompute_modules or []):
        raise ConfigError(
            f"parallel.offload_activations {sorted(inside_moe)} lie inside the MoE layer that "
            "model.foundation.recompute_modules=[moe] recomputes; drop one of them (megatron's rule)"
        )
    if t.dtype not in DTYPES:
        raise ConfigError(f"train.dtype={t.dtype!r}; allowed: {', '.join(DTYPES)}")
    if cfg.model.lora is not None and not t.init_from:
        raise ConfigError("model.lora needs train.init_from: the base weights the adapters train on "
                          "(a Loong checkpoint or an HF directory)")  # fmt: skip
    if t.steps < 0:
        raise ConfigError(f"train.steps={t.steps} must be >= 0 (0 saves the initial weights)")
    if t.resume_schedule not in SCHEDULE_CHOICES:
        raise ConfigError(f"train.resume_schedule={t.resume_schedule!r}; allowed: {', '.join(SCHEDULE_CHOICES)}")
    if t.export_hf_interval < 0:
        raise ConfigError(
            f"train.export_hf_interval={t.export_hf_interval} must be >= 0 (0 = at the end only)"
        )
    for key in ("micro_batch_size", "global_batch_size", "log_interval", "nonfinite_limit"):
        if getattr(t, key) < 1:
            raise ConfigError(f"train.{key}={getattr(t, key)} must be >= 1")
    if cfg.data.seq_length < 2 or cfg.data.seq_length > f.max_position_embeddings:
        raise ConfigError(
            f"data.seq_length={cfg.data.seq_length} must be in [2, model.foundation.max_position_embeddings="
            f"{f.max_position_embeddings}]"
        )
    dp = cfg.parallel.data_parallel_size(world_size)
    per_step = t.micro_batch_size * dp
    if t.global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} must be a multiple of train.micro_batch_size "
            f"x data-parallel size = {t.micro_batch_size} x {dp} = {per_step}"
        )
    d = cfg.data
    if d.kind not in DATA_KINDS:
        raise ConfigError(f"data.kind={d.kind!r}; allowed: {', '.join(DATA_KINDS)}")
    if d.kind == "chat" and d.packing != "fixed":
        raise ConfigError("data.kind=chat trains one conversation per data.seq_length row: use data.packing=fixed")
    for error in validate_packing(
        d.packing,
        d.thd,
        d.balance,
        seq_length=d.seq_length,
        tp=cfg.parallel.tp,
        sequence_parallel=cfg.parallel.sequence_parallel,
    ):
        raise ConfigError(error)
    for error in validate_multimodal(d.kind, d.multimodal, packing=d.packing, balance=d.balance.enabled):
        raise ConfigError(error)
    if not 0.0 < cfg.data.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction={cfg.data.val_fraction} must be in (0, 1)")
    return t.global_batch_size // per_step
