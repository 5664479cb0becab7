"""The train app's config: the composition of the packages' configs (each package owns and checks
its own node), plus the checks that span packages. Hydra composes the YAML groups; this schema
validates the result before anything starts, so a bad key or value fails naming the key."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

import loong_parallel.context_parallel as cp_rules
import loong_parallel.runtime as runtime_rules
from loong_ckpt.run_dir import ResumeSchedule
from loong_data.step_data import DataConfig, PatchGeometry
from loong_models import ModelConfig
from loong_parallel import OptimConfig, ParallelConfig, ProfileConfig
from loong_parallel.context_parallel import context_parallel_conflicts
from loong_parallel.encoder_layout import encoder_layout_errors


class DType(StrEnum):
    auto = "auto"  # the accelerator's preferred dtype (bf16 on GPU, fp32 on CPU)
    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"


@dataclass
class TrainConfig:
    steps: int = 100  # 0: only initialise and save (a common starting point for several runs)
    micro_batch_size: int = 4
    global_batch_size: int = 16
    seed: int = 1234
    dtype: DType = DType.auto
    device: str = "auto"  # LOONG_DEVICE: auto | cuda | cpu | an installed plugin
    output_dir: str = "runs/default"
    log_interval: int = 1
    sync_steps: bool = True  # false: no device sync at a step's end (the next one queues during its update)
    time_compute: bool = False  # true: each step's forward-backward timed apart (logged as compute_s)
    eval_interval: int = 50  # 0 = no periodic eval (a final eval still runs when eval_iters > 0)
    eval_iters: int = 4
    save_interval: int = 0  # 0 = save at the end only
    save_final: bool = True  # save a checkpoint when the run ends (benchmarks turn it off)
    keep_last: int = 2  # complete checkpoints kept (and always the newest one that verified)
    overwrite: bool = False  # a fresh run may replace another run's output in output_dir
    resume_schedule: ResumeSchedule = ResumeSchedule.refuse
    nonfinite_limit: int = 5  # steps in a row with a NaN / Inf loss or gradient (each skipped) before the run stops
    init_from: str | None = None  # model weights (not optimizer) from a checkpoint or an HF directory
    export_hf: bool = False  # write HF weights (output_dir/hf/step_N) at the end ...
    export_hf_interval: int = 0  # ... and every N steps (0 = only at the end)
    tensorboard: bool = True
    progress: bool = True
    profile: ProfileConfig = field(default_factory=ProfileConfig)  # a torch-profiler window (train.profile.start_step)

    def errors(self) -> list[str]:
        errors = []
        if self.steps < 0:
            errors.append(f"train.steps={self.steps} must be >= 0 (0 saves the initial weights)")
        if self.export_hf_interval < 0:
            errors.append(f"train.export_hf_interval={self.export_hf_interval} must be >= 0 (0 = at the end only)")
        errors += [f"train.{key}={getattr(self, key)} must be >= 1"
                   for key in ("micro_batch_size", "global_batch_size", "log_interval", "nonfinite_limit") if getattr(self, key) < 1]  # fmt: skip
        return errors + self.profile.errors()


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
    """Check every node and the rules between them; return the number of micro-batches per step."""
    try:
        _validate_packages(cfg, world_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    for error in [*cfg.train.errors(), *_cross_package_errors(cfg), *cfg.data.errors()]:
        raise ConfigError(error)
    t = cfg.train
    dp = cfg.parallel.data_parallel_size(world_size)
    per_step = t.micro_batch_size * dp
    if t.global_batch_size % per_step:
        raise ConfigError(f"train.global_batch_size={t.global_batch_size} must be a multiple of train.micro_batch_size "
                          f"x data-parallel size = {t.micro_batch_size} x {dp} = {per_step}")  # fmt: skip
    return t.global_batch_size // per_step


def _validate_packages(cfg: Config, world_size: int) -> None:
    shape = cfg.model.layout_shape()  # the trained transformer's (the foundation, or a DiT)
    moe = shape["moe"]
    cfg.model.validate()  # every component (foundation, image encoder, projector, token ids)
    if cfg.model.lora is not None:
        cfg.model.lora.validate()
    cfg.optim.validate()
    cfg.parallel.validate(
        world_size, shape["num_layers"], shape["num_attention_heads"], shape["query_groups"],
        num_experts=moe.num_experts if moe else None, expert_ffn_hidden_size=moe.ffn_hidden_size if moe else None,
        has_shared_experts=bool(moe and moe.shared_expert_intermediate_size),
    )  # fmt: skip


def _cross_package_errors(cfg: Config) -> list[str]:
    f, d, p = cfg.model.foundation, cfg.data, cfg.parallel
    errors = []
    inside_moe = {"expert_fc1", "moe_act"} & {str(m) for m in p.offload_activations}
    if inside_moe and "moe" in (f.recompute_modules or []):
        errors.append(f"parallel.offload_activations {sorted(inside_moe)} lie inside the MoE layer that "
                      "model.foundation.recompute_modules=[moe] recomputes; drop one of them (megatron's rule)")  # fmt: skip
    if cfg.model.lora is not None and not cfg.train.init_from:
        errors.append("model.lora needs train.init_from: the base weights the adapters train on "
                      "(a Loong checkpoint or an HF directory)")  # fmt: skip
    if d.seq_length < 2 or d.seq_length > f.max_position_embeddings:
        errors.append(f"data.seq_length={d.seq_length} must be in [2, model.foundation.max_position_embeddings="
                      f"{f.max_position_embeddings}]")  # fmt: skip
    if d.packing == "thd" and p.sequence_parallel and d.seq_length % p.tp:
        errors.append(f"data.seq_length={d.seq_length} must be a multiple of parallel.tp={p.tp} for packed "
                      "sequences with sequence parallelism")  # fmt: skip
    if d.kind == "multimodal" and cfg.model.image_encoder is None:
        errors.append("data.kind=multimodal (images in the data) but model.image_encoder is null: the model "
                      "cannot see images; choose a VLM, e.g. model=tiny-vlm")  # fmt: skip
    if (d.kind == "diffusion") != cfg.model.is_diffusion:
        errors.append(f"data.kind={d.kind} with model.diffusion={'set' if cfg.model.is_diffusion else 'null'}: a "
                      "diffusion model (e.g. model=wan-tiny) trains on data.kind=diffusion, and only it does")  # fmt: skip
    return (errors + _balance_errors(cfg) + encoder_layout_errors(p.encoder_layout, cfg.model, p.tp)
            + _context_parallel_errors(cfg) + _chunkpipe_errors(cfg) + _runtime_conflicts(cfg))


def _runtime_conflicts(cfg: Config) -> list[str]:
    """The runtime options (loong_parallel.runtime) this model, data and layout cannot run with."""
    p, m, packing = cfg.parallel, cfg.model, cfg.data.packing
    return [*runtime_rules.cuda_graph_conflicts(p, m, packing), *runtime_rules.wgrad_fusion_conflicts(p, m),
            *runtime_rules.output_loss_conflicts(p, m), *runtime_rules.fused_qkv_rope_conflicts(p, m, packing)]


def _chunkpipe_errors(cfg: Config) -> list[str]:
    """What ChunkPipe (parallel.chunkpipe.chunk_size) cannot run with, beyond the layout's rules
    (loong_parallel.ParallelConfig): it takes one sample per micro-batch of a GQA / MHA or MLA
    language model and recomputes the chunks itself."""
    if cfg.parallel.chunkpipe.chunk_size is None:
        return []
    f, d = cfg.model.foundation, cfg.data
    cannot = {
        **cfg.parallel.chunkpipe.moe_conflicts(f.moe),
        f"train.micro_batch_size={cfg.train.micro_batch_size} (it needs 1: one sample or pack per micro-batch)":
            cfg.train.micro_batch_size != 1,
        "model.foundation.sparse_attention (DeepSeek sparse attention)": f.sparse_attention is not None,
        "model.foundation.mtp_num_layers (multi-token prediction)": bool(f.mtp_num_layers),
        f"model.foundation.recompute={f.recompute} (ChunkPipe recomputes every chunk but the last itself)":
            f.recompute is not None,
        f"data.kind={d.kind} (ChunkPipe runs language models on token data)": d.kind not in ("text", "chat"),
    }  # fmt: skip
    return [f"parallel.chunkpipe cannot combine with {what}" for what, present in cannot.items() if present]


def _context_parallel_errors(cfg: Config) -> list[str]:
    if cfg.model.is_diffusion:
        return _diffusion_context_parallel_errors(cfg)
    e = cfg.model.image_encoder
    return context_parallel_conflicts(cfg.parallel, seq_length=cfg.data.seq_length, features={
        **cp_rules.cp_comm_type_conflicts(cfg.parallel, cfg.model.foundation),
        **(cp_rules.encoder_context_parallel_conflicts(cfg.parallel, e.tensor_model_parallel_size) if e else {}),
    })  # fmt: skip


def _diffusion_context_parallel_errors(cfg: Config) -> list[str]:
    """A DiT's self-attention is bidirectional over each sample's video tokens: they are cut into
    cp contiguous parts (no load balancing), and all-to-all CP trades heads for tokens."""
    p, heads = cfg.parallel, cfg.model.diffusion.num_attention_heads
    a2a_heads = str(p.cp_comm_type) == "a2a" and (heads // p.tp) % p.cp != 0
    return context_parallel_conflicts(p, seq_length=cfg.data.seq_length, balanced=False, features={
        f"parallel.cp_comm_type=a2a (model.diffusion.num_attention_heads={heads} / parallel.tp={p.tp} heads per "
        "rank must divide by parallel.cp; use p2p)": a2a_heads,
        **cp_rules.cp_comm_type_conflicts(p, None),
        "parallel.balance.enabled=true (the DP balancer would split a CP group's samples)": p.balance.enabled,
    })  # fmt: skip


def _balance_errors(cfg: Config) -> list[str]:
    b, d = cfg.parallel.balance, cfg.data
    errors = []
    if b.enabled and d.packing != "thd":
        errors.append("parallel.balance.enabled=true needs data.packing=thd")
    if b.max_tokens_per_rank is not None and b.max_tokens_per_rank < d.seq_length:
        errors.append(f"parallel.balance.max_tokens_per_rank={b.max_tokens_per_rank} must be null or "
                      f">= data.seq_length ({d.seq_length})")  # fmt: skip
    return errors


def patch_geometry(model: ModelConfig) -> PatchGeometry | None:
    """How the model cuts images into patches: the data's image processor follows the model (a
    diffusion model: its DiT's latent patch, frames x height x width)."""
    if model.diffusion is not None:
        pf, ph, pw = model.diffusion.patch_size
        return PatchGeometry(patch_size=ph, temporal_patch_size=pf, merge_size=1)
    e = model.image_encoder
    if e is None:
        return None
    return PatchGeometry(patch_size=e.patch_size, temporal_patch_size=e.temporal_patch_size,
                         merge_size=e.spatial_merge_size)  # fmt: skip


def check_data_fits_model(model: ModelConfig, tokenizer) -> None:
    """The tokenizer's ids fit the model: its vocabulary, and a VLM's vision token ids."""
    try:
        model.check_tokenizer(tokenizer.vocab_size, getattr(tokenizer, "vision", None), source=str(tokenizer.path))
    except ValueError as e:
        raise ConfigError(str(e)) from None
