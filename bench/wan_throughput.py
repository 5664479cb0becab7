"""Loong vs diffusers: Wan DiT training throughput on one GPU, in one run.

Both stacks train the same shape (default: Wan2.1-T2V-1.3B, random init) in the same plain torch
loop on the same samples: a video of --frames x --height x --width pixels as Wan2.1-VAE latents
(stride 4 x 8 x 8: 81 x 480 x 832 -> 16 x 21 x 60 x 104, patches 1 x 2 x 2 -> 32,760 tokens),
--text-len umT5-XXL embeddings (4096 wide), flow-matching noise and timesteps drawn by
``loong_models.diffusion.FlowMatching`` from (seed, sample id), Wan's bell-weighted velocity MSE.
Latents and text embeddings are random (seeded by sample id): throughput does not depend on them.

Precision (the same for both, megatron's mixed precision): bf16 weights, activations and
gradients, fp32 master weights and AdamW states (lr 1e-4, betas 0.9/0.999, wd 0.01, clip 1.0,
fused on CUDA). Full layer recompute by default (32,760 tokens do not fit otherwise): Loong's
``diffusion.recompute=full``, diffusers' ``enable_gradient_checkpointing()``.
Loong: ``loong_models`` WanModel built the way the train app builds it (``DiffusionModel``; TE
layers when transformer-engine imports, else the local backend); diffusers:
``WanTransformer3DModel`` with its default attention (torch SDPA). Each stack runs in its own
process; the table reports the median step time after --warmup steps.

    python bench/wan_throughput.py                                  # both, 1.3B, 81x480x832
    python bench/wan_throughput.py --steps 12 --warmup 4 --recompute none --frames 21
    python bench/wan_throughput.py --model wan-tiny --device cpu --dtype fp32 --frames 5 --height 32 --width 48

Before any figure the script asserts that both stacks consumed identical samples at every step:
each worker hashes the tensors it fed its model (noisy latents, timesteps, text embeddings,
targets, weights) and the digests must agree step by step.
latent tokens/s = samples x tokens per sample / median step time. MFU = tokens/s x
``WanConfig.flops_per_token(tokens)`` / 989 TFLOP/s (H100/H200 dense bf16): 6 x the per-token matmul
parameters of the layers + 12 L d s self-attention + 12 L d text_len cross-attention (the
design's 6 N T + 12 L h T^2 + 12 L h T 512; recompute is not counted, as usual for MFU).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

PEAK_BF16 = 989e12  # H100 / H200 dense bf16, DESIGN.md
VAE_STRIDE = (4, 8, 8)  # Wan2.1 VAE: frames (causal: 1 + 4k -> 1 + k), height, width
STACKS = ("loong", "diffusers")


def latent_shape(args, cfg) -> tuple[int, int, int, int]:
    """(channels, frames, height, width) of the VAE latents of a --frames x --height x --width clip."""
    (sf, sh, sw), (pf, ph, pw) = VAE_STRIDE, cfg.patch_size
    if (
        (args.frames - 1) % sf
        or (1 + (args.frames - 1) // sf) % pf
        or args.height % (sh * ph)
        or args.width % (sw * pw)
    ):
        raise SystemExit(f"--frames {args.frames} must be 1 + 4k (latent frames a multiple of {pf}) and "
                         f"--height/--width multiples of {sh * ph}/{sw * pw} (VAE stride x patch)")  # fmt: skip
    return cfg.in_channels, 1 + (args.frames - 1) // sf, args.height // sh, args.width // sw


def tokens_per_sample(args, cfg) -> int:
    _, f, h, w = latent_shape(args, cfg)
    pf, ph, pw = cfg.patch_size
    return (f // pf) * (h // ph) * (w // pw)


def model_config(args):
    from loong_models import load_model_config

    over = [f"diffusion.recompute={'full' if args.recompute == 'full' else 'null'}", *args.model_overrides]
    if args.layers:
        over.append(f"diffusion.num_layers={args.layers}")
    return load_model_config(args.model, over)


def sample_inputs(args, cfg, objective, step: int) -> dict[str, torch.Tensor]:
    """Step ``step``'s batch on the host: latents and text of sample ids step*batch.., noised."""
    ids = [step * args.batch + j for j in range(args.batch)]
    lat, ctx = [], []
    for i in ids:
        g = torch.Generator().manual_seed(1_000 + i)
        lat.append(torch.randn(latent_shape(args, cfg.diffusion), generator=g))
        ctx.append(torch.randn(args.text_len, cfg.diffusion.text_dim, generator=g))
    fm = objective.prepare(torch.stack(lat), ids, seed=args.seed)
    return dict(
        noisy=fm.noisy, timestep=fm.timestep, context=torch.stack(ctx), target=fm.target, weight=fm.weight
    )


def digest(batch: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(batch):
        h.update(k.encode())
        h.update(batch[k].contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


class MasterAdamW:
    """AdamW on fp32 master copies of low-precision parameters (megatron's mixed precision):
    grads are cast up, clipped, stepped, and the result is copied back into the model."""

    def __init__(self, params, fused: bool) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.master = [p.detach().float().clone().requires_grad_() for p in self.params]
        self.opt = torch.optim.AdamW(self.master, lr=1e-4, betas=(0.9, 0.999), weight_decay=0.01, fused=fused)

    @torch.no_grad()
    def step(self) -> float:
        for m, p in zip(self.master, self.params):
            m.grad = p.grad.float() if p.grad is not None else torch.zeros_like(m)
            p.grad = None
        norm = torch.nn.utils.clip_grad_norm_(self.master, 1.0)
        self.opt.step()
        torch._foreach_copy_(self.params, self.master)
        return float(norm)


def build_loong(cfg, dtype: torch.dtype, device: str, backend: str):
    from loong_parallel.config import ParallelConfig
    from loong_parallel.diffusion import DiffusionModel

    cfg.layer_backend = backend
    kind = DiffusionModel.from_config(cfg, device)
    config = kind.transformer_config(ParallelConfig(), dtype=dtype, device_type=device)
    model = kind.provider(config, ParallelConfig(), device_type=device)(True, True, None).to(device)
    return lambda b: model(b["noisy"], b["timestep"], b["context"]), model, kind.backend


def build_diffusers(cfg, dtype: torch.dtype, device: str):
    from diffusers import WanTransformer3DModel

    from loong_ckpt.diffusion import wan_to_diffusers

    model = WanTransformer3DModel.from_config(wan_to_diffusers(cfg.diffusion)).to(device, dtype)
    if cfg.diffusion.recompute == "full":
        model.enable_gradient_checkpointing()
    return lambda b: model(b["noisy"], b["timestep"], b["context"], return_dict=False)[0], model, "sdpa"


def train(args, forward, model, device: str, dtype: torch.dtype, cfg, stack: str) -> dict:
    from loong_models.diffusion import FlowMatching, FlowMatchingConfig
    from loong_parallel import ProfileConfig, StepProfiler

    window = ProfileConfig(start_step=args.warmup + 1 if args.profile else 0, steps=2, dir=f"{args.profile}/{stack}")
    profiler = StepProfiler(window, Path(args.profile or "."), rank=0, device_type=device)

    objective = FlowMatching(cfg.flow_matching or FlowMatchingConfig())
    opt = MasterAdamW(model.parameters(), fused=device == "cuda")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    model.train()
    times, losses, digests = [], [], []
    for step in range(args.steps):
        profiler.before(step + 1)
        host = sample_inputs(args, cfg, objective, step)
        digests.append(digest(host))
        b = {k: v.to(device, dtype if k in ("noisy", "context") else torch.float32) for k, v in host.items()}
        sync()
        t0 = time.perf_counter()
        pred = forward(b)
        loss = ((pred.float() - b["target"]).pow(2).flatten(1).mean(1) * b["weight"]).mean()
        loss.backward()
        opt.step()
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        profiler.after(step + 1)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0
    return dict(times=times, losses=losses, digests=digests, peak_mem_gib=peak)


def run_here(args, stack: str) -> dict:
    """Train ``stack`` in this process; its run as a dict (step times, losses, digests, memory)."""
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    cfg = model_config(args)
    torch.manual_seed(args.seed)
    if stack == "diffusers":
        if args.device == "cuda":
            torch.cuda.set_device(0)
        forward, model, impl = build_diffusers(cfg, dtype, args.device)
        out = train(args, forward, model, args.device, dtype, cfg, stack)
    else:
        from loong_xpu import get_accelerator
        from loong_xpu.testing import megatron_world

        with megatron_world(get_accelerator(args.device)):
            forward, model, impl = build_loong(cfg, dtype, args.device, args.loong_backend)
            out = train(args, forward, model, args.device, dtype, cfg, stack)
    return dict(out, stack=stack, impl=impl, params=sum(p.numel() for p in model.parameters()))


@dataclass(frozen=True)
class Row:
    stack: str
    impl: str
    median_s: float
    tokens_per_s: float
    mfu: float
    peak_mem_gib: float
    first_loss: float
    last_loss: float


def check_same_data(runs: dict[str, dict]) -> None:
    """Every stack ran the same steps on the same samples (digests of what each fed its model)."""
    (a, ra), *rest = runs.items()
    for b, rb in rest:
        if len(ra["digests"]) != len(rb["digests"]):
            raise SystemExit(f"{a} ran {len(ra['digests'])} steps, {b} ran {len(rb['digests'])}")
        for step, (x, y) in enumerate(zip(ra["digests"], rb["digests"]), 1):
            if x != y:
                raise SystemExit(f"step {step}: {a} and {b} trained on different samples (digest {x} != {y})")


def summarize(args, cfg, runs: dict[str, dict]) -> list[Row]:
    tokens = tokens_per_sample(args, cfg.diffusion)
    flops_per_token = cfg.diffusion.flops_per_token(tokens)
    rows = []
    for stack, r in runs.items():
        med = statistics.median(r["times"][args.warmup :])
        tps = args.batch * tokens / med
        rows.append(Row(stack, r["impl"], med, tps, tps * flops_per_token / PEAK_BF16, r["peak_mem_gib"],
                        r["losses"][0], r["losses"][-1]))  # fmt: skip
    return rows


def run_stack(args, stack: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--stack", stack, *sys_args(args)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{stack} worker failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def sys_args(args) -> list[str]:
    out = [f"--model={args.model}", f"--frames={args.frames}", f"--height={args.height}", f"--width={args.width}",
           f"--batch={args.batch}", f"--text-len={args.text_len}", f"--steps={args.steps}", f"--warmup={args.warmup}",
           f"--recompute={args.recompute}", f"--dtype={args.dtype}", f"--device={args.device}", f"--seed={args.seed}",
           f"--loong-backend={args.loong_backend}", f"--layers={args.layers or 0}"]  # fmt: skip
    out += [f"--profile={args.profile}"] if args.profile else []
    return out + [f"--model-override={o}" for o in args.model_overrides]


def main(argv: list[str] | None = None) -> list[Row]:
    args = parse_args(argv)
    if args.worker:  # one stack in its own process: one JSON line
        print("RESULT " + json.dumps(run_here(args, args.stack)), flush=True)
        return []
    if args.warmup >= args.steps:
        raise SystemExit(f"--warmup {args.warmup} must be < --steps {args.steps}")
    cfg = model_config(args)
    tokens = tokens_per_sample(args, cfg.diffusion)
    print(f"{args.model}: {cfg.diffusion.num_parameters() / 1e9:.3f}B params, {cfg.diffusion.num_layers} layers, "
          f"latents {latent_shape(args, cfg.diffusion)} -> {tokens} tokens/sample, batch {args.batch}, "
          f"{args.dtype}, recompute {args.recompute}", flush=True)  # fmt: skip
    runs = {s: run_stack(args, s) for s in args.stacks}
    check_same_data(runs)
    rows = summarize(args, cfg, runs)
    print(
        f"{'stack':10} {'impl':6} {'step s':>8} {'tokens/s':>10} {'MFU':>6} {'peak GiB':>9} {'loss first/last':>18}"
    )
    for r in rows:
        print(f"{r.stack:10} {r.impl:6} {r.median_s:8.3f} {r.tokens_per_s:10.0f} {r.mfu:6.3f} {r.peak_mem_gib:9.1f} "
              f"{r.first_loss:8.4f}/{r.last_loss:.4f}")  # fmt: skip
    by = {r.stack: r for r in rows}
    if len(by) == 2:
        print(f"ratio loong/diffusers tokens/s: {by['loong'].tokens_per_s / by['diffusers'].tokens_per_s:.3f} "
              f"(same samples at all {args.steps} steps)")  # fmt: skip
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="wan2.1-1.3b")
    p.add_argument("--layers", type=int, default=0, help="cut the DiT to this many layers (0 = all)")
    p.add_argument("--model-override", dest="model_overrides", action="append", default=[])
    p.add_argument("--frames", type=int, default=81)
    p.add_argument("--height", type=int, default=480)
    p.add_argument("--width", type=int, default=832)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--text-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--recompute", choices=("full", "none"), default="full")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--loong-backend", choices=("auto", "te", "local"), default="auto")
    p.add_argument("--profile", help="write each stack's operator table of the 2 steps after warm-up to DIR/<stack>/")
    p.add_argument("--stacks", nargs="+", choices=STACKS, default=list(STACKS))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--stack", choices=STACKS, help=argparse.SUPPRESS)
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
