"""The training loop: set up, then step, evaluate, checkpoint. Everything parallel is delegated
to loong-parallel, every model detail to loong-models, every file format to loong-ckpt."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
from megatron.core import parallel_state as mpu
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from loong_ckpt.components import checkpoint_meta
from loong_ckpt.online import export_hf, is_hf_dir, load_hf_weights
from loong_ckpt.run_dir import RUN_CONFIG_KEY
from loong_ckpt.training import load_checkpoint, read_checkpoint_info, save_checkpoint
from loong_models import build_model, build_transformer_config, fusion_fields, resolve_backend
from loong_models.lora import LoraError
from loong_models.packed_seq import packed_seq_params
from loong_parallel import (
    LOSS_KEY,
    NonFiniteGuard,
    RouterStats,
    build_model_chunks,
    build_optimizer,
    eval_step,
    init_distributed,
    initialize_model_parallel,
    runtime_transformer_fields,
    shutdown,
    train_step,
)
from loong_train.data import load_text_data, step_batches
from loong_train.log import logger
from loong_train.metrics import MetricsWriter, progress_bar
from loong_train.multimodal import (
    MEDIA_KEYS,
    encoder_process_groups,
    load_multimodal_data,
    step_counts,
    vision_flops_per_patch,
)
from loong_train.run_state import apply_schedule_choice, claim_output_dir, resume_point, run_config
from loong_train.schema import Config, ConfigError, validate
from loong_train.thd import build_balancer, schedule_shape
from loong_xpu import Accelerator, get_accelerator, redirect_cuda

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class RunSummary:
    first_loss: float | None = None
    last_loss: float | None = None
    eval_loss: float | None = None
    checkpoint: Path | None = None
    hf_export: Path | None = None
    metrics_file: Path | None = None
    tensorboard_dir: Path | None = None
    tokens_per_s: float | None = None


def lm_forward_step(device: torch.device, data_iterator, model, return_schedule_plan: bool = False):
    """megatron forward_step: per-token LM loss on the last stage, hidden states elsewhere.
    Packed (THD) batches carry ``cu_seqlens``: attention stays inside each document. Multimodal
    batches also carry images / videos (``MEDIA_KEYS``), which go to the model as keywords.
    ``return_schedule_plan``: megatron's combined 1F1B schedule (MoE all-to-all overlap) asks for
    the model's schedule plan of this micro-batch instead of running its forward."""
    batch = next(data_iterator)
    tokens = batch["tokens"].to(device, non_blocking=True)
    packed = None
    if "cu_seqlens" in batch:
        packed = packed_seq_params(batch["cu_seqlens"].to(device, non_blocking=True), batch["max_seqlen"])
    media = {key: batch[key].to(device, non_blocking=True) for key in MEDIA_KEYS
             if key in batch and batch[key].numel()}  # a pack without images has empty tensors  # fmt: skip
    run = model.build_schedule_plan if return_schedule_plan else model
    output = run(
        tokens,
        batch["position_ids"].to(device, non_blocking=True),
        None,  # causal mask is implied by the layer spec
        labels=batch["labels"].to(device, non_blocking=True),
        packed_seq_params=packed,
        **media,
    )
    return output, partial(_lm_loss, batch["loss_mask"].to(device, non_blocking=True))


def _lm_loss(loss_mask: torch.Tensor, per_token_loss: torch.Tensor):
    mask = loss_mask.reshape(-1).float()
    loss_sum = (per_token_loss.reshape(-1).float() * mask).sum()
    num_tokens = mask.sum()
    return loss_sum, num_tokens.to(torch.int), {LOSS_KEY: torch.stack([loss_sum.detach(), num_tokens])}


def _iterators(microbatches: list[dict], num_chunks: int):
    its = [iter(microbatches) for _ in range(num_chunks)]
    return its if num_chunks > 1 else its[0]


def _resolve_dtype(name: str, accel: Accelerator) -> torch.dtype:
    return accel.preferred_dtype if name == "auto" else _DTYPES[name]


def run(cfg: Config) -> RunSummary:
    accel = get_accelerator(None if cfg.train.device == "auto" else cfg.train.device)
    with redirect_cuda(accel):
        env = init_distributed(accel)
        try:
            return _train(cfg, accel, env.rank == 0, env.world_size)
        finally:
            shutdown()


def _train(cfg: Config, accel: Accelerator, is_main: bool, world_size: int) -> RunSummary:
    t, f = cfg.train, cfg.model.foundation
    num_microbatches = validate(cfg, world_size)
    dtype = _resolve_dtype(t.dtype, accel)
    device = accel.device()
    out_dir = Path(t.output_dir)
    ckpt_root = out_dir / "checkpoints"

    initialize_model_parallel(cfg.parallel, world_size)
    claim_output_dir(cfg, out_dir, is_main)  # before anything is loaded or written
    resumed = resume_point(cfg, ckpt_root, is_main)
    model_parallel_cuda_manual_seed(t.seed)
    torch.manual_seed(t.seed)  # identical host RNG on every rank: CPU init is layout independent

    multimodal = cfg.data.kind == "multimodal"
    if multimodal:  # images + conversations (multimodal.py); it checks model and tokenizer agree
        data = load_multimodal_data(cfg.data, cfg.model, is_main=is_main, seed=t.seed)
    else:
        data = load_text_data(cfg.data, is_main=is_main, seed=t.seed)
    if data.tokenizer.vocab_size > f.vocab_size:
        raise ConfigError(
            f"model.foundation.vocab_size={f.vocab_size} is smaller than the tokenizer's vocabulary "
            f"({data.tokenizer.vocab_size}, {data.tokenizer.path})"
        )

    backend = resolve_backend(cfg.model.layer_backend, accel.device_type)
    try:  # the layout and layer backend decide the rest (CUDA-only options, grouped-GEMM experts)
        tconfig = build_transformer_config(
            f,
            **runtime_transformer_fields(cfg.parallel, dtype=dtype, device_type=accel.device_type),
            **fusion_fields(backend),
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None

    encoder_groups = encoder_process_groups(cfg.model, cfg.parallel.tp)

    def provider(pre_process: bool, post_process: bool, vp_stage: int | None) -> torch.nn.Module:
        return build_model(cfg.model, tconfig, device_type=accel.device_type, pre_process=pre_process,
                           post_process=post_process, vp_stage=vp_stage,
                           encoder_pg_collection=encoder_groups)  # fmt: skip

    try:
        chunks = build_model_chunks(provider, cfg.parallel, tconfig, accel)
    except LoraError as e:
        raise ConfigError(str(e)) from None
    lora = cfg.model.lora
    trainable = sum(p.numel() for c in chunks for p in c.parameters() if p.requires_grad)
    total_trainable = torch.tensor([trainable], device=device)
    torch.distributed.all_reduce(total_trainable)
    if total_trainable.item() == 0:
        raise ConfigError("nothing to train: every parameter is frozen (model.<component>.freeze, model.lora)")
    optimizer, scheduler = build_optimizer(cfg.optim, cfg.parallel, chunks, dtype=dtype, total_steps=t.steps)
    start_step = 0
    if resumed is not None:
        apply_schedule_choice(cfg, scheduler)
    if lora is not None and resumed is not None:
        _check_lora_base(resumed, t.init_from)
    if t.init_from and (resumed is None or lora is not None):
        # With LoRA the checkpoints hold the adapters only: the frozen base always comes from init_from.
        _load_weights(t.init_from, chunks, cfg.model, part="frozen" if lora is not None else "all", is_main=is_main)
    if resumed is not None:
        info, rng = load_checkpoint(
            resumed.path, chunks, optimizer, scheduler, rng_state_template=_rng_state(accel), verify=False
        )
        if rng is not None:
            _set_rng_state(accel, rng)
        start_step = info.step
        if is_main:
            logger.info("resumed from %s (step %d)", info.path, start_step)
    if t.init_from and resumed is None:
        # bf16 / fp16 optimizers keep fp32 main copies made when they were built: refresh them from
        # the weights just loaded, or the first step would write the random init back (no-op in fp32).
        optimizer.reload_model_params()

    n_params = f.num_parameters()
    n_active = f.num_active_parameters()  # = n_params for dense models; MFU counts what a token uses
    tokens_per_step = t.global_batch_size * cfg.data.seq_length
    flops_per_token = 6 * n_active + 6 * f.num_layers * f.hidden_size * cfg.data.seq_length
    peak = accel.peak_flops(dtype)
    if is_main:
        moe = (
            f"{n_active / 1e6:.1f}M active, {f.moe.num_experts} experts top-{f.moe.router_topk}, "
            if f.moe
            else ""
        )
        experts = f" | experts: ep {cfg.parallel.ep} x etp {cfg.parallel.expert_tp}" if f.moe else ""
        logger.info(
            "model %s (%.1fM params, %s%s layers%s) | %s | dtype %s | layers: %s | world %d = tp %d x pp %d x dp %d%s | "
            "global batch %d x seq %d, %d micro-batches/step | trainable params (rank 0): %.3fM%s",
            f.family, n_params / 1e6, moe, f.num_layers,
            f"; + {(cfg.model.num_parameters() - n_params) / 1e6:.2f}M image encoder + projector" if multimodal else "",
            accel.name, str(dtype).removeprefix("torch."), backend,
            world_size, cfg.parallel.tp, cfg.parallel.pp, mpu.get_data_parallel_world_size(), experts,
            t.global_batch_size, cfg.data.seq_length, num_microbatches, trainable / 1e6,
            f" (LoRA rank {lora.rank} on {', '.join(lora.targets)})" if lora else "",
        )  # fmt: skip

    dp_rank, dp_size = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
    sched = dict(
        num_microbatches=num_microbatches, seq_length=cfg.data.seq_length, micro_batch_size=t.micro_batch_size
    )
    b = cfg.data.balance
    balancer = build_balancer(
        num_parameters=n_active, num_layers=f.num_layers, attention_width=f.num_attention_heads * f.head_dim,
        group=mpu.get_data_parallel_group(), device=device, min_imbalance=b.min_imbalance,
        max_tokens=b.max_tokens_per_rank, refit=b.refit, warmup_steps=b.refit_warmup_steps,
        interval=b.refit_interval, window=b.refit_window,
    ) if b.enabled else None  # fmt: skip
    if multimodal:
        batches = data.train_steps(global_batch_size=t.global_batch_size, dp_rank=dp_rank, dp_size=dp_size,
                                   start_step=start_step)  # fmt: skip
        patch_flops = vision_flops_per_patch(cfg.model)
    else:
        batches = step_batches(
            data.train, micro_batch_size=t.micro_batch_size, num_microbatches=num_microbatches,
            dp_rank=dp_rank, dp_size=dp_size, seed=t.seed, start_step=start_step, balancer=balancer,
        )  # fmt: skip
    forward_step = partial(lm_forward_step, device)
    router_stats = RouterStats(chunks, tconfig, device) if f.moe else None
    metrics = MetricsWriter(out_dir, enabled=is_main, tensorboard=t.tensorboard, resume_step=start_step)
    summary = RunSummary(metrics_file=metrics.path, tensorboard_dir=metrics.tb_dir if t.tensorboard else None)

    def evaluate(step: int) -> float:
        if multimodal:  # the same held-out samples every time
            mbs = data.eval_microbatches(num_samples=t.eval_iters * t.micro_batch_size * dp_size,
                                         dp_rank=dp_rank, dp_size=dp_size)  # fmt: skip
        else:
            mbs = next(step_batches(
                data.val, micro_batch_size=t.micro_batch_size, num_microbatches=t.eval_iters,
                dp_rank=dp_rank, dp_size=dp_size, seed=t.seed,
            ))  # fmt: skip
        loss, _ = eval_step(forward_step, _iterators(mbs, len(chunks)), chunks, device=device,
                            **schedule_shape(mbs, {**sched, "num_microbatches": len(mbs)}))  # fmt: skip
        metrics.write({"step": step, "split": "val", "loss": loss})
        return loss

    # The model config goes with the weights: loong-convert mcore-to-hf needs nothing else.
    ckpt_extra = {"tokens_per_step": tokens_per_step, **checkpoint_meta(cfg.model), RUN_CONFIG_KEY: run_config(cfg)}
    if t.init_from and is_hf_dir(t.init_from):
        ckpt_extra["hf_config"] = json.loads((Path(t.init_from) / "config.json").read_text())
    if lora is not None:  # adapters only; loong-convert merges them into `base` on export
        ckpt_extra["lora"] = {**asdict(lora), "base": str(Path(t.init_from).absolute())}

    def save(step: int) -> Path:
        return save_checkpoint(
            ckpt_root, step, chunks, optimizer, scheduler, rng_state=_rng_state(accel),
            extra=ckpt_extra, keep_last=t.keep_last, trainable_only=lora is not None,
        )  # fmt: skip

    def export(step: int, checkpoint: Path) -> Path:
        tok = Path(data.tokenizer.path)
        return export_hf(
            checkpoint, out_dir / "hf" / f"step_{step:08d}", tokenizer=tok if tok.is_dir() else tok.parent
        )

    nonfinite = NonFiniteGuard(t.nonfinite_limit)
    bar = progress_bar(t.steps, start_step, enabled=is_main and t.progress)
    window_t0, window_tokens, window_images, window_flops, window_steps = time.perf_counter(), 0, 0, 0.0, 0
    for step in range(start_step + 1, t.steps + 1):
        step_t0 = time.perf_counter()
        mbs = next(batches)
        result = train_step(forward_step, _iterators(mbs, len(chunks)), chunks, optimizer, scheduler, device=device,
                            synchronize=accel.synchronize if balancer else None, **schedule_shape(mbs, sched))  # fmt: skip
        if balancer:
            balancer.observe(mbs, result.compute_s)
        accel.synchronize()
        step_time = time.perf_counter() - step_t0
        if multimodal:  # every real token (loss only on assistant tokens), and the images
            counts = step_counts(mbs, data.tokenizer.pad_id, mpu.get_data_parallel_group(), device)
            window_tokens += counts["tokens"]
            window_images += counts["images"]
            window_flops += flops_per_token * counts["tokens"] + patch_flops * counts["patches"]
        else:
            window_tokens += result.num_tokens  # loss tokens: every token in fixed packing, real ones in THD
            window_flops += flops_per_token * result.num_tokens
        window_steps += 1
        if summary.first_loss is None:
            summary.first_loss = result.loss
        summary.last_loss = result.loss
        log_now = step % t.log_interval == 0 or step == t.steps
        if result.nonfinite and not log_now:  # every skipped step is on record
            metrics.write({"step": step, "loss": result.loss, "skipped": True, "nonfinite": True})
        if log_now:
            elapsed = time.perf_counter() - window_t0
            tps = window_tokens / elapsed
            summary.tokens_per_s = tps
            record = {
                "step": step, "loss": result.loss, "lr": result.lr, "grad_norm": result.grad_norm,
                "tokens_per_s": tps, "tokens_per_s_per_device": tps / world_size, "step_time_s": step_time,
                "skipped": result.skipped, "nonfinite": result.nonfinite,
            }  # fmt: skip
            if balancer:
                record.update(balancer.metrics())
            if multimodal:
                record["images_per_s"] = window_images / elapsed
            postfix = {}
            if router_stats:
                moe_stats = router_stats.report(num_microbatches * window_steps, step)
                record.update(moe_stats)
                postfix = {
                    k.removeprefix("moe_"): f"{v:.3g}"
                    for k, v in moe_stats.items()
                    if not isinstance(v, list)
                }
            if peak:
                record["mfu"] = window_flops / elapsed / world_size / peak
            mem = accel.memory_stats()
            record["peak_mem_gib"] = round(mem.peak_allocated / 2**30, 3)
            metrics.write(record)
            bar.set_postfix(loss=f"{result.loss:.4f}", tok_s=f"{tps:,.0f}", **postfix, refresh=False)
            window_t0, window_tokens, window_images, window_flops, window_steps = time.perf_counter(), 0, 0, 0.0, 0
        bar.update(1)
        nonfinite.observe(step, result)  # raises after train.nonfinite_limit in a row
        if t.eval_interval and t.eval_iters and step % t.eval_interval == 0 and step != t.steps:
            evaluate(step)
        want_export = t.export_hf and t.export_hf_interval and step % t.export_hf_interval == 0
        if (want_export or (t.save_interval and step % t.save_interval == 0)) and step != t.steps:
            summary.checkpoint = save(step)
            if want_export:
                summary.hf_export = export(step, summary.checkpoint)
    bar.close()
    if router_stats:
        router_stats.close()
    if t.eval_iters:
        summary.eval_loss = evaluate(t.steps)
    if t.save_final or t.export_hf:
        summary.checkpoint = save(t.steps)
    if t.export_hf:
        summary.hf_export = export(t.steps, summary.checkpoint)
    metrics.close()
    return summary


def _load_weights(init_from: str, chunks: list, model_cfg, *, part: str, is_main: bool) -> None:
    """Model weights (not optimizer state) from an HF directory or a Loong checkpoint."""
    if is_hf_dir(init_from):
        load_hf_weights(init_from, chunks, model_cfg)  # every component of a VLM; never LoRA adapters
        return
    info, _ = load_checkpoint(read_checkpoint_info(init_from).path, chunks, part=part)
    if is_main:
        logger.info("initialised model weights from %s", info.path)


def _check_lora_base(resumed, init_from: str | None) -> None:
    """A LoRA checkpoint's adapters belong to the base weights it was trained on."""
    base = (resumed.meta.get("lora") or {}).get("base")
    if base is None:
        raise ConfigError(f"{resumed.path} is not a LoRA checkpoint but model.lora is set; resume it without LoRA "
                          "or start a LoRA run in another train.output_dir")  # fmt: skip
    if init_from is None or Path(init_from).absolute() != Path(base):
        raise ConfigError(f"train.init_from={init_from!r} but the LoRA checkpoint {resumed.path} was trained on "
                          f"{base}; resume with train.init_from={base}")  # fmt: skip


def _rng_state(accel: Accelerator) -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return {
        "cpu": torch.get_rng_state(),
        "device": accel.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(accel: Accelerator, state: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(state["cpu"])
    accel.set_rng_state(state["device"])
    get_cuda_rng_tracker().set_states(state["tracker"])
