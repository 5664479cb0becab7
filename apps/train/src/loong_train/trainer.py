"""The trainer: a run in named phases. ``Trainer(cfg).fit()`` sets up, restores, steps, evaluates,
saves and closes; what differs between runs is the model kind and the step data, never a branch
here. Everything parallel is loong-parallel's, every model detail loong-models', every file format
loong-ckpt's, every sample loong-data's.

Extension seams (apps/train/README.md): a model kind is a ``loong_parallel.ModelKind`` passed as
``Trainer(cfg, model=...)``; a data kind is a ``loong_data.step_data.DataKind`` with its loader, or
a ``StepData`` factory passed as ``Trainer(cfg, data=...)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from loong_ckpt.online import export_hf
from loong_ckpt.restore import RestoreError, restore, run_meta
from loong_ckpt.run_metrics import MetricsWriter
from loong_ckpt.training import save_checkpoint
from loong_data.step_data import StepCounts, StepData, StepLayout, build_step_data
from loong_parallel import (
    DataParallel,
    ModelKind,
    NonFiniteGuard,
    StepClock,
    StepProfiler,
    StepResult,
    StepWindow,
    build_balancer,
    build_model_chunks,
    build_optimizer,
    chunkpipe_schedule,
    data_parallel,
    eval_step,
    init_distributed,
    initialize_model_parallel,
    microbatch_iterators,
    model_kind,
    require_features,
    rng_state,
    schedule_shape,
    seed_everything,
    set_rng_state,
    shutdown,
    train_step,
)
from loong_train.log import logger
from loong_train.schema import Config, ConfigError, check_data_fits_model, patch_geometry, validate
from loong_xpu import get_accelerator, redirect_cuda

# Packs shorter than data.seq_length are padded to a multiple of this (TE's FP8 GEMMs need 16).
PACK_MULTIPLE = 128
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


def step_layout(cfg: Config, *, num_microbatches: int, dp: DataParallel | None = None,
                device: torch.device | None = None) -> StepLayout:  # fmt: skip
    """What the data needs to know about the run (``dp`` None: a single process)."""
    t, p = cfg.train, cfg.parallel
    static = p.pp > 1 or p.chunkpipe.enabled  # pipeline stages (and ChunkPipe) exchange fixed shapes
    return StepLayout(micro_batch_size=t.micro_batch_size, global_batch_size=t.global_batch_size,
                      num_microbatches=num_microbatches, eval_iters=t.eval_iters, seed=t.seed, device=device,
                      segment_multiple=2 * p.cp if p.cp > 1 else 1,
                      pack_multiple=None if static else math.lcm(PACK_MULTIPLE, p.tp),  # SP splits packs over TP
                      **(dict(dp_rank=dp.rank, dp_size=dp.size, dp_group=dp.group) if dp else {}))  # fmt: skip


def run_data(cfg: Config, layout: StepLayout, *, is_main: bool = True) -> StepData:
    """The run's step data for ``layout``'s DP rank, checked against the model."""
    data = build_step_data(cfg.data, layout, is_main=is_main, patches=patch_geometry(cfg.model))
    check_data_fits_model(cfg.model, data.tokenizer)
    return data


class Trainer:
    """One training run. ``model``: the model kind (default: the zoo's language models, VLMs
    included, built from ``cfg.model``); ``data``: ``data(layout) -> StepData`` (default: from
    ``cfg.data``). Construction runs :meth:`setup` and :meth:`restore`."""

    def __init__(self, cfg: Config, model: ModelKind | None = None,
                 data: Callable[[StepLayout], StepData] | None = None):  # fmt: skip
        self.cfg = cfg
        self._exit = ExitStack()
        try:
            self.setup(model, data)
            self.start_step = self.restore()
        except BaseException:
            self._exit.close()
            raise

    # --- setup ------------------------------------------------------------------------------------

    def setup(self, model: ModelKind | None, data: Callable[[StepLayout], StepData] | None = None) -> None:
        """Devices and process groups, data, model chunks, optimizer, metrics."""
        cfg, t = self.cfg, self.cfg.train
        self.accel = get_accelerator(None if t.device == "auto" else t.device)
        try:  # e.g. layer_backend=te or FP8 on a backend without them: refused before anything is built
            require_features(cfg.model, cfg.parallel, self.accel)
        except ValueError as e:  # UnsupportedFeatureError, or an FP8 policy that does not fit
            raise ConfigError(str(e)) from None
        self._exit.enter_context(redirect_cuda(self.accel))
        owns_process_group = not dist.is_initialized()
        env = init_distributed(self.accel)
        self._exit.callback(shutdown, process_group=owns_process_group)
        self.is_main, self.world_size, self.device = env.rank == 0, env.world_size, self.accel.device()
        self.num_microbatches = validate(cfg, env.world_size)
        self.dtype = self.accel.preferred_dtype if t.dtype == "auto" else _DTYPES[t.dtype]
        initialize_model_parallel(cfg.parallel, env.world_size)
        graph_safe = cfg.parallel.cuda_graphs != "none"  # CUDA graphs need TE's graph-safe RNG tracker
        seed_everything(t.seed, graph_safe=graph_safe)
        self.dp = data_parallel()
        layout = step_layout(cfg, num_microbatches=self.num_microbatches, dp=self.dp, device=self.device)
        self.data = data(layout) if data else run_data(cfg, layout, is_main=self.is_main)
        # preparing data may draw from the host RNG (a diffusion job builds its random towers on a
        # cold cache): seed again so that the initial weights do not depend on the cache's state
        seed_everything(t.seed, graph_safe=graph_safe)
        tokens = cfg.data.seq_length * t.micro_batch_size // cfg.parallel.cp  # one micro-batch's GEMM rows
        self.model = model or model_kind(cfg.model, self.accel.device_type, seed=t.seed, tokens_per_microbatch=tokens)
        self._build_model()
        self.optimizer, self.scheduler = build_optimizer(cfg.optim, cfg.parallel, self.chunks, dtype=self.dtype,
                                                         total_steps=t.steps)  # fmt: skip
        self.out_dir = Path(t.output_dir)

    def _build_model(self) -> None:
        p, device_type = self.cfg.parallel, self.accel.device_type
        try:
            self.tconfig = self.model.transformer_config(p, dtype=self.dtype, device_type=device_type)
            provider = self.model.provider(self.tconfig, p, device_type=device_type)
            self.chunks = build_model_chunks(provider, p, self.tconfig, self.accel)
        except ValueError as e:  # the layout, backend or LoRA targets do not fit the model
            raise ConfigError(str(e)) from None
        self.schedule = None  # megatron's pipeline schedules for the layout
        if p.chunkpipe.chunk_size is not None:
            try:  # the model's attention must be chunkable (GQA / MHA with RoPE)
                self.schedule = chunkpipe_schedule(self.chunks, p.chunkpipe.chunk_size, self.device)
            except ValueError as e:
                raise ConfigError(f"parallel.chunkpipe: {e}") from None
        trainable = sum(q.numel() for c in self.chunks for q in c.parameters() if q.requires_grad)
        total = torch.tensor([trainable], device=self.device)
        dist.all_reduce(total)
        if total.item() == 0:
            raise ConfigError("nothing to train: every parameter is frozen (model.<component>.freeze, model.lora)")
        self.trainable_params = trainable

    # --- restore ----------------------------------------------------------------------------------

    def restore(self) -> int:
        """Weights from ``train.init_from``, or the run's newest checkpoint (``resume``); the step
        to continue after."""
        t = self.cfg.train
        try:
            restored = restore(self.out_dir / "checkpoints", self.chunks, self.optimizer, self.scheduler,
                               model_cfg=self.cfg.model, init_from=t.init_from, resume=self.cfg.resume,
                               rng_state_template=rng_state(self.accel), config=self.cfg, overwrite=t.overwrite,
                               resume_schedule=t.resume_schedule)  # fmt: skip
        except RestoreError as e:
            raise ConfigError(str(e)) from None
        if restored.rng is not None:
            set_rng_state(self.accel, restored.rng)
        return restored.step

    # --- the loop ---------------------------------------------------------------------------------

    def fit(self) -> RunSummary:
        """Steps from the restored one to ``train.steps``, with periodic evaluation and saves, then
        the final evaluation and save. Closes the trainer."""
        t = self.cfg.train
        try:
            self._start_loop()
            for step in range(self.start_step + 1, t.steps + 1):
                self.profiler.before(step)
                result = self.step(step)
                self.profiler.after(step)
                self._log(step, result)
                self.nonfinite.observe(step, result)  # raises after train.nonfinite_limit in a row
                if step != t.steps:
                    with self.clock.paused():  # evaluations and saves are no step's time
                        self._periodic(step)
            self._finish()
            return self.summary
        finally:
            self.close()

    def _start_loop(self) -> None:
        t, dp = self.cfg.train, self.dp
        self.balancer = build_balancer(self.cfg.parallel.balance, **self.model.cost_shape(), group=dp.group,
                                       device=self.device)  # fmt: skip
        self.batches = self.data.train_steps(self.start_step, self.balancer)
        self.forward_step = self.model.forward_step(self.device)
        self.step_stats = self.model.step_stats(self.chunks, self.tconfig, self.device)
        if self.step_stats is not None:
            self._exit.callback(self.step_stats.close)
        self.metrics = MetricsWriter(self.out_dir, enabled=self.is_main, tensorboard=t.tensorboard,
                                     resume_step=self.start_step)  # fmt: skip
        self._exit.callback(self.metrics.close)
        self.summary = RunSummary(metrics_file=self.metrics.path, tensorboard_dir=self.metrics.tb_dir if t.tensorboard else None)
        self.bar = tqdm(total=t.steps, initial=self.start_step, disable=not (self.is_main and t.progress), unit="step",
                        dynamic_ncols=True, desc="train")  # fmt: skip
        self._exit.callback(self.bar.close)
        self.window = StepWindow()
        self.profiler = StepProfiler(t.profile, self.out_dir, rank=dist.get_rank(), device_type=self.accel.device_type)
        self._exit.callback(self.profiler.close)
        self.ckpt_meta = run_meta(self.cfg.model, init_from=t.init_from, config=self.cfg,
                                  tokens_per_step=t.global_batch_size * self.cfg.data.seq_length)  # fmt: skip
        self.nonfinite = NonFiniteGuard(t.nonfinite_limit)
        self.clock = StepClock(self.accel.synchronize if t.sync_steps else None)
        self._log_start()

    def step(self, step: int) -> StepResult:
        """One optimizer step on the next global batch (its time: loong_parallel.StepClock)."""
        t0 = self.clock.start()
        mbs = next(self.batches)
        # the balancer learns from compute times; train.time_compute logs them (a device sync before the update)
        sync = self.accel.synchronize if self.balancer or self.cfg.train.time_compute else None
        result = train_step(self.forward_step, microbatch_iterators(mbs, len(self.chunks)), self.chunks, self.optimizer,
                            self.scheduler, device=self.device, synchronize=sync, forward_backward_func=self.schedule,
                            **schedule_shape(mbs))  # fmt: skip
        if self.balancer:
            self.balancer.observe(mbs, result.compute_s)
        counts: StepCounts = self.data.counts(mbs, result.num_tokens)
        flops = self.model.flops(counts, seq_length=self.cfg.data.seq_length)
        self.window.add(counts, flops, step_time=self.clock.lap(t0))
        return result

    def evaluate(self, step: int) -> float:
        """Mean loss over the held-out micro-batches (the same every time)."""
        mbs = self.data.eval_microbatches()
        loss, _ = eval_step(self.forward_step, microbatch_iterators(mbs, len(self.chunks)), self.chunks,
                            device=self.device, forward_backward_func=self.schedule, **schedule_shape(mbs))  # fmt: skip
        self.metrics.write({"step": step, "split": "val", "loss": loss})
        return loss

    def save(self, step: int) -> Path:
        """A checkpoint of the model, optimizer, scheduler and RNG (only the adapters with LoRA)."""
        t = self.cfg.train
        self.summary.checkpoint = save_checkpoint(
            self.out_dir / "checkpoints", step, self.chunks, self.optimizer, self.scheduler,
            rng_state=rng_state(self.accel), extra=self.ckpt_meta, keep_last=t.keep_last,
            trainable_only=self.cfg.model.lora is not None,
        )  # fmt: skip
        return self.summary.checkpoint

    def export(self, step: int) -> Path:
        """HF weights of the checkpoint just saved, with the tokenizer."""
        tok = Path(self.data.tokenizer.path)
        self.summary.hf_export = export_hf(self.summary.checkpoint, self.out_dir / "hf" / f"step_{step:08d}",
                                           tokenizer=tok if tok.is_dir() else tok.parent)  # fmt: skip
        return self.summary.hf_export

    def close(self) -> None:
        """Metrics, progress bar, router hooks, process groups (those this trainer created)."""
        self._exit.close()

    # --- what the loop does around the steps -------------------------------------------------------

    def _periodic(self, step: int) -> None:
        t = self.cfg.train
        if t.eval_interval and t.eval_iters and step % t.eval_interval == 0:
            self.evaluate(step)
        want_export = t.export_hf and t.export_hf_interval and step % t.export_hf_interval == 0
        if want_export or (t.save_interval and step % t.save_interval == 0):
            self.save(step)
            if want_export:
                self.export(step)

    def _finish(self) -> None:
        t = self.cfg.train
        self.bar.close()
        if self.step_stats is not None:
            self.step_stats.close()
        if t.eval_iters:
            self.summary.eval_loss = self.evaluate(t.steps)
        if t.save_final or t.export_hf:
            self.save(t.steps)
        if t.export_hf:
            self.export(t.steps)

    def _log(self, step: int, result: StepResult) -> None:
        t, s = self.cfg.train, self.summary
        s.first_loss = result.loss if s.first_loss is None else s.first_loss
        s.last_loss = result.loss
        if step % t.log_interval == 0 or step == t.steps or result.nonfinite:  # every skipped step on record
            record, postfix = self.window.record(step, result, world_size=self.world_size,
                                                 peak_flops=self.accel.peak_flops(self.dtype))  # fmt: skip
            s.tokens_per_s = record["tokens_per_s"]
            if self.balancer:
                record.update(self.balancer.metrics())
            if self.step_stats is not None:
                stats = self.step_stats.report(self.num_microbatches * self.window.steps, step)
                record.update(stats)
                postfix.update({k.removeprefix("moe_"): f"{v:.3g}" for k, v in stats.items() if not isinstance(v, list)})
            record["peak_mem_gib"] = round(self.accel.memory_stats().peak_allocated / 2**30, 3)
            self.metrics.write(record)
            self.bar.set_postfix(**postfix, refresh=False)
            self.window = StepWindow()
        self.bar.update(1)

    def _log_start(self) -> None:
        if not self.is_main:
            return
        t, p = self.cfg.train, self.cfg.parallel
        moe = self.cfg.model.foundation.moe
        experts = f" | experts: ep {p.ep} x etp {p.expert_tp}" if moe else ""
        experts += f" | ChunkPipe: chunks of {p.chunkpipe.chunk_size} tokens" if p.chunkpipe.chunk_size else ""
        logger.info(
            "model %s | %s | dtype %s | layers: %s | world %d = tp %d x pp %d x dp %d%s | global batch %d x seq %d, "
            "%d micro-batches/step | trainable params (rank 0): %.3fM",
            self.model.describe(), self.accel.name, str(self.dtype).removeprefix("torch."), self.model.backend,
            self.world_size, p.tp, p.pp, self.dp.size, experts, t.global_batch_size, self.cfg.data.seq_length,
            self.num_microbatches, self.trainable_params / 1e6,
        )  # fmt: skip
