"""Mixture-of-Experts training throughput with expert parallelism, in one run: the baseline EP
layout, then the same with the expert-parallel all-to-all overlapped with computation, then with
activation offload to host memory (more variants: the overlap with the weight gradients computed
apart, megatron's delay_wgrad_compute; offload at every point). Each variant is a separate torchrun job of the real train app.

Default shape: qwen3-30b-a3b reduced to 4 layers (all 128 experts, top-8 routing, hidden 2048,
GQA 32/4 heads), sequence 4096, bf16 with fp32 master weights and the distributed optimizer, the
TE layer spec (grouped-GEMM experts) when transformer-engine is installed, alltoall dispatcher,
EP = number of GPUs (dense part data-parallel over the same GPUs), 4 micro-batches per step.

    python bench/moe_throughput.py                                  # 4 GPUs, the default three variants
    python bench/moe_throughput.py --gpus 2 --layers 8
    python bench/moe_throughput.py --variants baseline a2a-overlap --extra parallel.moe_token_dispatcher=alltoall
    python bench/moe_throughput.py --mbs 2 --variants baseline offload offload-all   # where activations weigh
    python bench/moe_throughput.py --levers --mbs 4 --variants baseline a2a-overlap     # GPU-bound micro-batches
    python bench/moe_throughput.py --levers --mbs 4 --forced-routing --variants baseline a2a-overlap  # balanced
    python bench/moe_throughput.py --levers --mbs 4 --microbatches 8 --variants baseline cutlass a2a-overlap-cutlass  # TE's CUTLASS grouped GEMM
    python bench/moe_throughput.py --levers --mbs 4 --microbatches 8 --variants cublaslt a2a-overlap-cublaslt  # TE's cuBLASLt grouped GEMM
    python bench/moe_throughput.py --levers --microbatches 64 --precision-aware --variants baseline offload-optimizer
    python bench/moe_throughput.py --levers --precision-aware --variants baseline offload-optimizer@1 offload-optimizer@0.6
    python bench/moe_throughput.py --levers --microbatches 64 --precision-aware --variants baseline offload-optimizer@1 offload-optimizer-device@1  # host vs device update
    python bench/moe_throughput.py --levers --microbatches 64 --precision-aware --extra optim.state_dtype=bf16 --variants baseline offload-optimizer-device@1  # bf16 moments on both sides
    python bench/moe_throughput.py --levers --microbatches 64 --precision-aware --variants baseline offload-optimizer-device@1 offload-optimizer-remainder@1  # fp32 masters vs low halves
    python bench/moe_throughput.py --levers --microbatches 64 --precision-aware --rounds 2 --variants baseline offload-optimizer-device@1  # A B, then B A
    # rounds too long for one call of a lent machine: one order per call, each saved, then pooled
    python bench/moe_throughput.py ... --save-runs a.jsonl --variants baseline offload-optimizer-device@1
    python bench/moe_throughput.py ... --save-runs b.jsonl --variants offload-optimizer-device@1 baseline
    python bench/moe_throughput.py --pool a.jsonl b.jsonl
    # where the step goes: each step's forward-backward timed apart from the rest (the update)
    python bench/moe_throughput.py ... --time-compute --variants baseline offload-optimizer-device@1

Each variant also prints the router's load imbalance (busiest expert over the mean) and the EP
ranks' (busiest rank's routed tokens over the mean rank's): with unequal expert work the
all-to-all makes the other ranks wait, which no overlap can hide.

Each variant prints its losses and gradient norms by step; the bench exits unless the variants'
step-1 losses agree within 1e-2 (same samples, same initial weights: the data ranks of a torchrun
job report no batch digests). The table gives each variant's median step (over all rounds with
--rounds) and two ratios to the baseline: that of the medians, and the median of the per-step
ratios (step k of one against step k of the other, which routed the same tokens). --pool reads
runs that several invocations saved (--save-runs), refuses runs of other settings or samples, and
pools each variant's runs as rounds.

--time-compute (a device sync before each step's update, in every variant) splits each step into
the forward-backward and the rest (the batch's fetch, the gradients' finalisation, the optimizer's
update, the loss read) and the table adds each variant's medians of both, the rest's difference to the baseline,
and the ratio the baseline's median step would have with that difference alone. An optimizer
variant changes only the rest, while the forward-backward of 64 micro-batches on a lent machine
spreads by more than the update costs; the split tells the two apart.

MFU = (6 N + 6 L h s) * tokens/s/GPU / peak (989 TFLOP/s bf16 on H100/H200), N = the parameters
one token uses (active: attention, router, top-k experts, embeddings), as the train app reports.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from train_app import run_train_app  # noqa: E402

PEAK = 989e12

# What each variant adds to the baseline EP layout.
VARIANTS: dict[str, list[str]] = {
    "baseline": [],
    # megatron's combined 1F1B schedule: one micro-batch's dispatch/combine all-to-all runs while
    # another micro-batch computes (needs ep > 1, bf16, >= 2 micro-batches)
    "a2a-overlap": ["parallel.moe_a2a_overlap=true"],
    # + TE's weight gradients computed apart (megatron's delay_wgrad_compute): more to overlap
    "a2a-overlap-dw": ["parallel.moe_a2a_overlap=true", "parallel.moe_delay_wgrad=true"],
    # TE's CUTLASS grouped GEMM for the experts (one launch per layer and GEMM, not one per expert;
    # Hopper, BF16): less host time a micro-batch, which the combined schedule needs most
    "cutlass": ["++model.grouped_gemm_kernel=cutlass"],
    "a2a-overlap-cutlass": ["parallel.moe_a2a_overlap=true", "++model.grouped_gemm_kernel=cutlass"],
    # TE's cuBLASLt grouped GEMM (Hopper: cuBLASLt >= 13.4): the weight gradients grouped as well
    "cublaslt": ["++model.grouped_gemm_kernel=cublaslt"],
    "a2a-overlap-cublaslt": ["parallel.moe_a2a_overlap=true", "++model.grouped_gemm_kernel=cublaslt"],
    # the inputs of the experts' first linear and of their activation wait in host memory
    "offload": ["parallel.offload_activations=[expert_fc1,moe_act]"],
    # every offload point megatron has: the attention's and the MLP's inputs wait in host memory too
    "offload-all": ["parallel.offload_activations=[attn_norm,qkv_linear,core_attn,attn_proj,mlp_norm,expert_fc1,moe_act]"],
    # the optimizer's master weights and Adam moments in host memory, updated there (megatron's
    # HybridDeviceOptimizer; --precision-aware; the share: --optimizer-offload-fraction, or per
    # variant as offload-optimizer@0.6)
    "offload-optimizer": ["optim.offload_update=host"],
    # the same state in host memory, streamed through the GPU and updated there each step
    # (loong_xpu.offload_device_update); the share as above
    "offload-optimizer-device": ["optim.offload_update=device"],
    # the same, the masters kept as their low 16 bits beside the bf16 weights: 2 bytes each way, not 4
    "offload-optimizer-remainder": ["optim.offload_update=device", "optim.offload_master=remainder"],
}
OPTIMIZER_OFFLOAD = ("offload-optimizer", "offload-optimizer-device", "offload-optimizer-remainder")  # take a share

# The MoE levers that paid at EP=4 (--levers, added to every variant): TE's fused token permutation
# and router kernels (megatron's moe_permute_fusion / moe_router_fusion) and the weight-gradient
# GEMMs accumulating straight into main_grad. Together 1.30x the plain baseline on 4 H200s
# (8 micro-batches of 1: 1.468 -> 1.127 s a step; loong-parallel README, MoE section).
LEVERS = ["++model.foundation.extra.moe_permute_fusion=true", "++model.foundation.extra.moe_router_fusion=true",
          "parallel.wgrad_fusion=true"]  # fmt: skip

# a2a-overlap-dw is left out: 0.863x the baseline at this shape on 4 H100s (loong-parallel README)
DEFAULT_VARIANTS = ["baseline", "a2a-overlap", "offload"]


@dataclass(frozen=True)
class Result:
    variant: str
    step_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    peak_gib: float
    first_loss: float = float("nan")  # the loss of step 1, before any update
    step_times: tuple[float, ...] = ()  # the measured steps' times, in step order
    compute_times: tuple[float, ...] = ()  # their forward-backward parts (--time-compute), in step order


def paired_ratio(base: Result, r: Result) -> float:
    """The median over the measured steps of base's step time over r's at the same step. The
    variants train the same samples from the same weights, so step k routes alike in both: the
    routing's drift from step to step (which moves the busiest expert's work, and with it the step
    time, by up to 40% at 64 micro-batches) cancels in each pair, not only in the medians."""
    pairs = [b / v for b, v in zip(base.step_times, r.step_times, strict=True)]
    return statistics.median(pairs) if pairs else float("nan")


def check_same_samples(results: list[Result], tol: float = 1e-2, what: str = "variants") -> str:
    """The variants train the same samples from the same initial weights, so their step-1 losses
    (before any update) agree up to bf16 rounding of another execution order. Exits naming the
    first variant that differs otherwise (the variants' data ranks report no batch digests)."""
    base = results[0]
    for r in results[1:]:
        if not abs(r.first_loss - base.first_loss) <= tol:
            raise SystemExit(f"not the same samples: step-1 loss of {r.variant} {r.first_loss:.4f} vs "
                             f"{base.variant} {base.first_loss:.4f} (more than {tol} apart)")  # fmt: skip
    return f"same samples: the step-1 losses of all {len(results)} {what} agree within {tol} ({base.first_loss:.4f})"


def split_variant(variant: str) -> tuple[str, float | None]:
    """``offload-optimizer@0.6`` -> ("offload-optimizer", 0.6): a variant and the optimizer offload share
    it runs with (None: --optimizer-offload-fraction), so that one run can compare several shares."""
    name, at, share = variant.partition("@")
    return name, (float(share) if at else None)


def mfu(f, seq: int, tokens_per_s_per_gpu: float, peak: float = PEAK) -> float:
    """The model's own FLOP count (loong-models: N = active parameters) at this throughput."""
    return f.flops_per_token(seq) * tokens_per_s_per_gpu / peak


def foundation(args):
    from loong_models import load_model_config

    return load_model_config(args.model, [f"foundation.num_layers={args.layers}"]).foundation


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=4, help="decoder layers kept from the model's shape")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--mbs", type=int, default=1, help="micro-batch size")
    p.add_argument(
        "--microbatches", type=int, default=4, help="micro-batches per step and data-parallel rank"
    )
    p.add_argument("--gpus", type=int, default=4, help="processes (GPUs) of each torchrun job")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel size (default: --gpus)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-4,
                   help="peak learning rate (cosine to lr / 10), reached after --warmup steps; at the default "
                   "shape the routers' load imbalance went from 3.6-4.0 (steps 1-3) to 6.2-6.4 (steps 4-7) once it did. "
                   "A run's first steps normally sit early in a long warm-up: 1e-4 x 7 / 2000 = 3.5e-7 is "
                   "step 7's rate in a 2000-step warm-up")  # fmt: skip
    p.add_argument(
        "--forced-routing",
        action="store_true",
        help="megatron's forced load balancing instead of the router's own choice (default: real routing)",
    )
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the median")
    p.add_argument("--rounds", type=int, default=1,
                   help="runs of every variant, in alternating order (A B, B A, A B, ...): neither always runs "
                   "first, on a cooler GPU; medians over the measured steps of all rounds")  # fmt: skip
    p.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS,
                   help=f"any of {', '.join(VARIANTS)}; offload-optimizer[-device]@F: with offload share F")  # fmt: skip
    p.add_argument("--device", default="cuda", help="LOONG_DEVICE of the runs (cpu: smoke-test this script)")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--extra", nargs="*", default=[], help="extra train-app overrides for every variant")
    p.add_argument("--levers", action="store_true",
                   help="every variant with the MoE levers (TE's fused permutation and router, wgrad fusion; CUDA + TE)")  # fmt: skip
    p.add_argument(
        "--precision-aware",
        action="store_true",
        help="every variant on megatron's precision-aware optimizer (master weights inside TE's FusedAdam); "
        "offload-optimizer needs it, and then the baseline has it too",
    )
    p.add_argument("--profile-dir", type=Path, default=None,
                   help="profile one extra step after the measured ones: a Chrome trace per rank in DIR/<variant>")  # fmt: skip
    p.add_argument("--numa-binding", choices=["node", "socket", "exclusive", "core-complex"], default=None,
                   help="torchrun's --numa-binding for every variant: each process on the host CPUs nearest its "
                   "GPU (needs the numactl CLI); matters for offload-optimizer's host-side Adam")  # fmt: skip
    p.add_argument("--optimizer-offload-fraction", type=float, default=1.0,
                   help="offload-optimizer: the share of the optimizer's parameters updated on the host")  # fmt: skip
    p.add_argument("--time-compute", action="store_true",
                   help="time each step's forward-backward apart from the rest (train.time_compute, every variant)")
    p.add_argument("--save-runs", type=Path, default=None,
                   help="append each finished run to this JSON-lines file (for --pool; kept if a later run fails)")  # fmt: skip
    p.add_argument("--pool", type=Path, nargs="+", default=None,
                   help="train nothing: pool the runs saved by --save-runs in these files (same settings), "
                   "each variant's runs as rounds, and print the table; pool runs of one machine only (the "
                   "GPUs' names are printed, not compared)")  # fmt: skip
    args = p.parse_args(argv)
    for variant in args.variants:
        try:
            name, share = split_variant(variant)
        except ValueError:
            p.error(f"--variants {variant}: the share after @ must be a number")
        if name not in VARIANTS:
            p.error(f"--variants {variant}: unknown variant {name!r} (expected one of {', '.join(VARIANTS)})")
        if share is not None and (name not in OPTIMIZER_OFFLOAD or not 0 < share <= 1):
            p.error(f"--variants {variant}: only {' and '.join(OPTIMIZER_OFFLOAD)} take a share, in (0, 1]")
    if any(split_variant(v)[0] in OPTIMIZER_OFFLOAD for v in args.variants) and not args.precision_aware:
        p.error("the offload-optimizer variants need --precision-aware (megatron's host offload runs on its path)")
    args.ep = args.ep or args.gpus
    if args.gpus % args.ep:
        p.error(f"--ep {args.ep} must divide --gpus {args.gpus}")
    if len(set(args.variants)) < len(args.variants):
        p.error(f"--variants {' '.join(args.variants)}: each variant once (--rounds repeats them)")
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds} must be at least 1")
    if args.rounds > 1 and args.profile_dir:
        p.error("--profile-dir profiles one run of each variant: use it with --rounds 1")
    if args.steps <= args.warmup:
        p.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    return args


def train_command(args, variant: str, out: Path) -> list[str]:
    name, share = split_variant(variant)
    global_batch = args.mbs * args.microbatches * args.gpus  # dense data-parallel size = gpus (tp = pp = 1)
    overrides = [
        f"model={args.model}", f"model.foundation.num_layers={args.layers}", f"data.seq_length={args.seq}",
        f"train.micro_batch_size={args.mbs}", f"train.global_batch_size={global_batch}", f"train.steps={args.steps + (1 if args.profile_dir else 0)}",
        f"train.dtype={args.dtype}", "train.eval_iters=0", "train.save_final=false", "train.tensorboard=false",
        "train.progress=false", f"train.output_dir={out}", f"data.cache_dir={out.parent}/data",
        f"optim.warmup_steps={args.warmup}", f"parallel.ep={args.ep}", "parallel.distributed_optimizer=true",
        # a learning rate of this model size (the app's default 3e-3 is tuned for the 5M-parameter job)
        f"optim.lr={args.lr}", f"optim.min_lr={args.lr / 10}",
        # Real routing: the zoo's MoE models initialise embeddings with std 1.0 (embedding_init_std).
        # At 0.02 the routers of this width sent nearly every token to the same 8 experts (load
        # imbalance ~14 from step 1 on an H200 run; cause and test: test_moe_routing_init.py), so
        # one EP rank did all the expert work and overlap could not pay.
        *(["++model.foundation.extra.moe_router_force_load_balancing=true"] if args.forced_routing else []),
        *(["optim.precision_aware=true"] if args.precision_aware else []),
        *(["train.time_compute=true"] if args.time_compute else []),
        *VARIANTS[name],
        *([f"optim.offload_fraction={args.optimizer_offload_fraction if share is None else share}"]
          if name in OPTIMIZER_OFFLOAD else []),
        *(LEVERS if args.levers else []),
        *args.extra,
        # the profiled step comes after the measured ones and is left out of the median
        *([f"train.profile.start_step={args.steps + 1}", "train.profile.steps=1", "train.profile.trace=true",
           f"train.profile.dir={args.profile_dir / variant}"] if args.profile_dir else []),
    ]  # fmt: skip
    numa = [f"--numa-binding={args.numa_binding}"] if args.numa_binding else []
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.gpus}", *numa,
            "-m", "loong_train", *overrides]  # fmt: skip


def run_order(variants: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, variant) in the order they run: the variants as given, then reversed, and so on, so
    that no variant always runs first (step times on a lent GPU drift within minutes)."""
    return [(k, v) for k in range(rounds) for v in (variants if k % 2 == 0 else variants[::-1])]


def tokens_per_s_per_gpu(args, step_s: float) -> float:
    """Each GPU's tokens a step (its micro-batches; the dense part is data-parallel) over the step."""
    return args.mbs * args.microbatches * args.seq / step_s


def pooled(args, f, runs: list[Result]) -> Result:
    """One variant over all its rounds (in round order): the median of every measured step, the
    highest peak, the first round's step-1 loss."""
    times = tuple(t for r in runs for t in r.step_times)
    step_s = statistics.median(times)
    tps = tokens_per_s_per_gpu(args, step_s)
    return Result(runs[0].variant, step_s, tps, mfu(f, args.seq, tps), max(r.peak_gib for r in runs),
                  runs[0].first_loss, times, tuple(t for r in runs for t in r.compute_times))  # fmt: skip


def rest_times(r: Result) -> list[float]:
    """Each measured step's time outside its forward-backward (batch fetch, finalisation, update, loss read)."""
    return [t - c for t, c in zip(r.step_times, r.compute_times, strict=True)]


def split_lines(results: list[Result]) -> list[str]:
    """--time-compute: each variant's median forward-backward and median rest of a step, and for the
    others the rest's difference to the baseline's and the ratio the baseline's median step would
    have with that difference alone (what the variant's own work costs, apart from the spread of
    the forward-backward)."""
    base = next((r for r in results if r.variant == "baseline"), None)
    base_rest = statistics.median(rest_times(base)) if base else None
    lines = [f"{'where the step goes':<26} {'fwd-bwd s':>9} {'rest s':>7} {'rest - baseline':>16} {'ratio from it':>14}"]
    for r in results:
        rest = statistics.median(rest_times(r))
        extra = f"{'-':>16} {'-':>14}"
        if base is not None and r is not base:
            delta = rest - base_rest
            extra = f"{delta:+16.3f} {base.step_s / (base.step_s + delta):13.3f}x"
        lines.append(f"{r.variant:<26} {statistics.median(r.compute_times):9.3f} {rest:7.3f} {extra}")
    lines.append("rest: the step outside its forward-backward (the batch's fetch, the gradients' finalisation, "
                 "the update, the loss read); ratio from it: the baseline's median step over itself plus that "
                 "difference")  # fmt: skip
    return lines


# options that may differ between invocations whose runs are pooled: the order and how often the
# variants ran, and where things were written
NOT_SETTINGS = ("variants", "rounds", "save_runs", "pool", "profile_dir")


def settings(args) -> dict:
    """The options that make two invocations' runs comparable (every one but NOT_SETTINGS)."""
    return {k: v for k, v in sorted(vars(args).items()) if k not in NOT_SETTINGS}


def save_run(path: Path, args, rnd: int, first: bool, r: Result, device: str) -> None:
    """Append run ``r`` (round ``rnd``; ``first``: it ran first in its round) on ``device`` to ``path``."""
    record = {"settings": settings(args), "device": device, "round": rnd, "first": first,
              "result": dataclasses.asdict(r)}  # fmt: skip
    with path.open("a") as fh:
        fh.write(json.dumps(record) + "\n")


def load_runs(paths: list[Path]) -> tuple[dict, dict[str, list[Result]], dict[str, int], set[str]]:
    """The runs saved in ``paths``: their settings, each variant's runs in file and round order, how
    often each variant ran first in its round, and the devices they ran on. Exits naming the file
    and line of a run whose settings differ from the first run's, or naming a round that lacks a
    variant (a call cut short): the variants' runs are paired round by round."""
    first_settings, runs, first, devices, rounds = None, {}, {}, set(), {}
    for path in paths:
        try:
            lines = path.read_text().splitlines()
        except OSError as e:
            raise SystemExit(f"--pool {path}: cannot read it ({e.strerror})") from None
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                saved, result = record["settings"], Result(**record["result"])
            except (ValueError, KeyError, TypeError) as e:
                raise SystemExit(f"{path}:{n}: not a run saved by --save-runs ({e})") from None
            result = dataclasses.replace(result, step_times=tuple(result.step_times),
                                         compute_times=tuple(result.compute_times))  # fmt: skip
            if first_settings is None:
                first_settings = saved
            differ = sorted(k for k in first_settings.keys() | saved.keys() if first_settings.get(k) != saved.get(k))
            if differ:
                k = differ[0]
                raise SystemExit(f"{path}:{n}: run of {result.variant} has {k}={saved.get(k)!r}, "
                                 f"the first run {k}={first_settings.get(k)!r}; only runs of the same settings pool")  # fmt: skip
            runs.setdefault(result.variant, []).append(result)
            first[result.variant] = first.get(result.variant, 0) + bool(record.get("first"))
            devices.add(record.get("device", "?"))
            rounds.setdefault((str(path), record.get("round", 0)), set()).add(result.variant)
    if first_settings is None:
        raise SystemExit(f"--pool {' '.join(map(str, paths))}: no runs saved there")
    for (path, rnd), present in rounds.items():
        if present != runs.keys():
            missing = ", ".join(v for v in runs if v not in present)
            raise SystemExit(f"--pool {path}: round {rnd + 1} has no run of {missing}; the variants' runs are "
                             "paired round by round")  # fmt: skip
    return first_settings, runs, first, devices


def run_variant(args, variant: str, workdir: Path, f, rnd: int = 0) -> Result:
    out = workdir / (variant if rnd == 0 else f"{variant}-round{rnd + 1}")
    cmd = train_command(args, variant, out)
    print(f"{variant}:", " ".join(cmd[cmd.index("loong_train") + 1 :]), flush=True)
    # torchrun gives each process one host thread unless OMP_NUM_THREADS is set: the host's share
    # per process instead, for the host-side Adam of offload-optimizer (the same for every variant)
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // args.gpus))
    env = dict(os.environ, LOONG_DEVICE=args.device, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=threads)
    started = time.monotonic()
    rows = run_train_app(cmd, out, label=f"variant {variant}", env=env)
    wall = time.monotonic() - started
    train = [r for r in rows if args.warmup < r["step"] <= args.steps]
    if args.time_compute and any("compute_s" not in r for r in train):
        raise SystemExit(f"variant {variant}: --time-compute, but its metrics have steps without compute_s")
    step_s = statistics.median(r["step_time_s"] for r in train)
    tps = tokens_per_s_per_gpu(args, step_s)
    imbalance = statistics.mean(r.get("moe_load_imbalance", float("nan")) for r in train)
    ep_imbalance = statistics.mean(r.get("moe_ep_load_imbalance", float("nan")) for r in train)
    first = [round(r.get("moe_load_imbalance", float("nan")), 2) for r in rows[:3]]
    peak = max(r["peak_mem_gib"] for r in train)
    # printed as each variant ends: a run cut short by a time limit keeps the variants that finished
    print(f"   median step {step_s:.3f}s, {tps:,.0f} tokens/s/GPU, peak {peak:.2f} GiB (rank 0), "
          f"load imbalance (max/mean) {imbalance:.2f} (first steps {first}), EP ranks {ep_imbalance:.2f}",
          flush=True)  # fmt: skip
    # the variants train the same samples from the same weights: their losses and gradient norms
    # should agree step by step up to bf16 rounding of another execution order
    print(f"   loss by step {[round(r['loss'], 4) for r in rows]}", flush=True)
    print(f"   step s by step {[round(r['step_time_s'], 3) for r in rows]}", flush=True)  # the median's spread
    if args.time_compute:
        print(f"   forward-backward s by step {[round(r['compute_s'], 3) for r in rows if 'compute_s' in r]}", flush=True)
    print(f"   grad norm by step {[None if r.get('grad_norm') is None else round(r['grad_norm'], 4) for r in rows]}",
          flush=True)  # fmt: skip
    # what a run costs beyond its steps (start-up, model build, data): to plan runs in a time limit
    print(f"   run took {wall:.0f} s, {wall - sum(r['step_time_s'] for r in rows):.0f} s of it outside the steps",
          flush=True)  # fmt: skip
    return Result(variant, step_s, tps, mfu(f, args.seq, tps), peak, rows[0]["loss"],
                  tuple(r["step_time_s"] for r in train), tuple(r["compute_s"] for r in train if "compute_s" in r))


def table(args, f, results: list[Result], order: str = "in alternating order") -> str:
    lines = [
        f"{args.model} x {args.layers} layers: {f.num_parameters() / 1e9:.2f}B params, "
        f"{f.num_active_parameters() / 1e9:.2f}B active, {f.moe.num_experts} experts top-{f.moe.router_topk} | "
        f"seq {args.seq}, micro-batch {args.mbs} x {args.microbatches} | {args.gpus} GPUs, EP {args.ep} | "
        f"median of {args.steps - args.warmup} steps after {args.warmup}"
        + (f", {args.rounds} rounds {order}" if args.rounds > 1 else ""),
        f"{'variant':<22} {'step s':>8} {'tokens/s/GPU':>13} {'MFU':>6} {'peak GiB (rank 0)':>18} {'vs baseline':>12} "
        f"{'paired':>8}",
    ]
    base = next((r for r in results if r.variant == "baseline"), None)
    for r in results:
        ratio = f"{r.tokens_per_s_per_gpu / base.tokens_per_s_per_gpu:.3f}x" if base else "-"
        paired = f"{paired_ratio(base, r):.3f}x" if base and r.step_times else "-"
        lines.append(f"{r.variant:<22} {r.step_s:8.3f} {r.tokens_per_s_per_gpu:13,.0f} {r.mfu:6.3f} "
                     f"{r.peak_gib:18.2f} {ratio:>12} {paired:>8}")  # fmt: skip
    lines.append("vs baseline: the medians' ratio; paired: the median over steps of the baseline's step time "
                 "over the variant's at the same step")
    if results and all(r.compute_times for r in results):
        lines += split_lines(results)
    return "\n".join(lines)


def device_name(device: str) -> str:
    """The GPU's name for ``cuda``, else the device as given."""
    if device != "cuda":
        return device
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cuda (absent)"


def pool(paths: list[Path]) -> None:
    """--pool: the table of the runs saved in ``paths``, each variant's runs pooled as rounds, after
    checking that every run (not only each variant's first) trained the same samples."""
    saved, runs, first, devices = load_runs(paths)
    args = argparse.Namespace(**saved, variants=list(runs), rounds=len(next(iter(runs.values()))))
    f = foundation(args)
    results = [pooled(args, f, runs[v]) for v in args.variants]
    order = "ran first in its round: " + ", ".join(f"{v} {first[v]}x" for v in args.variants)
    print(f"pooled from {', '.join(map(str, paths))}\n{', '.join(sorted(devices))}")
    print(table(args, f, results, order=f"pooled ({order})"))
    print(check_same_samples([r for v in args.variants for r in runs[v]], what="runs"))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.pool:
        pool(args.pool)
        return
    f = foundation(args)
    device = device_name(args.device)
    runs: dict[str, list[Result]] = {v: [] for v in args.variants}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (rnd, variant) in enumerate(run_order(args.variants, args.rounds)):
            runs[variant].append(run_variant(args, variant, Path(tmp), f, rnd))
            if args.save_runs:
                save_run(args.save_runs, args, rnd, i % len(args.variants) == 0, runs[variant][-1], device)
    results = [pooled(args, f, runs[v]) for v in args.variants]
    print(f"\n{device}")
    print(table(args, f, results))
    if len(results) > 1:
        print(check_same_samples(results))


if __name__ == "__main__":
    main()
