"""Loong vs HF transformers: training throughput of one LLM shape on one GPU, in one run.

Both sides train the same shape (default: llama3.2-1b, seq 4096, micro-batch 2) on the same
batches (the bundled corpus, same sampler and seed), in bf16 with fp32 master weights, AdamW
(lr 3e-4, betas 0.9/0.95, wd 0.1, clip 1.0). Loong runs the real train app (TE layer spec and
fusions when transformer-engine is installed); HF runs LlamaForCausalLM with SDPA attention under
torch.autocast. Each side runs in its own process; the table reports the median over the steps
after warm-up. Every stack reports each step's batch digest (loong_data.batch_digest of the token
ids) and the bench states that they agree, or exits naming the first step that differs (Loong
reports none with DP > 1).

    python bench/llm_throughput.py                       # both, default shape
    python bench/llm_throughput.py --steps 30 --warmup 10 --hf-modes amp bf16
    python bench/llm_throughput.py --loong-extra model.layer_backend=local   # without TE
    python bench/llm_throughput.py --hf-modes --variants base= wgrad=++parallel.wgrad_fusion=true \
        fp8=++model.foundation.precision.fp8=on,++model.foundation.precision.recipe=tensorwise
    python bench/llm_throughput.py --hf-modes --variants base= graphs=++parallel.cuda_graphs=local  # CUDA graphs
    python bench/llm_throughput.py --mbs 4 --hf-modes bf16 --variants megatron= fused=++model.foundation.output_loss=fused
    python bench/llm_throughput.py --model llama3.1-8b --model-override foundation.num_layers=4 --seq 8192 --hf-modes
    python bench/llm_throughput.py --nproc 4 --tp 4 --model llama3.1-8b --model-override foundation.num_layers=4 \
        --seq 1024 --mbs 1 --hf-modes --variants bf16= adaptive=...   # TP=4 (+ SP) over 4 GPUs, torchrun

``--variants label=override,override ...`` runs Loong once per variant (same batches), on top of
``--loong-extra`` (a variant that fails, e.g. out of memory, is reported as failed and the others
still run); ``--model-override`` changes the model of every run (Loong, HF, the FLOP count).

MFU = (6 N + 6 L h s) * tokens/s / peak (989 TFLOP/s bf16 on H100/H200), N = parameters; with
``--nproc`` > 1 (Loong only: torchrun, TP = ``--tp`` with sequence parallelism, DP = the rest) the
tokens are the whole step's and MFU is per GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from same_data import StackCounts, check_same_data  # noqa: E402
from train_app import run_train_app  # noqa: E402

PEAK = 989e12


def foundation(model: str, overrides: list[str] = ()):
    from loong_models import load_model_config

    return load_model_config(model, list(overrides)).foundation


def parse_variants(specs: list[str]) -> list[tuple[str, list[str]]]:
    """``label=ov1,ov2`` -> (label, [ov1, ov2]); ``label=`` is the run with no extra overrides."""
    variants = []
    for spec in specs:
        label, sep, overrides = spec.partition("=")
        if not sep or not label:
            raise SystemExit(f"--variants {spec!r}: expected label=override,override (or label= for none)")
        variants.append((label, [o for o in overrides.split(",") if o]))
    return variants


def loong_command(args, out: Path, variant: list[str]) -> list[str]:
    """The train-app command of one Loong run (torchrun over ``--nproc`` processes when > 1)."""
    model_overrides = [o if o.startswith(("+", "~")) else f"model.{o}" for o in args.model_override]
    launch = [sys.executable] if args.nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}"]  # fmt: skip
    layout = [] if args.tp == 1 else [f"parallel.tp={args.tp}", "parallel.sequence_parallel=true"]
    return [
        *launch, "-m", "loong_train", f"model={args.model}", f"data.seq_length={args.seq}", *layout,
        f"train.micro_batch_size={args.mbs}", f"train.global_batch_size={args.mbs * dp_size(args)}",
        f"train.steps={args.steps}",
        "train.eval_iters=0", "train.save_final=false", "train.tensorboard=false", "train.progress=false",
        f"train.output_dir={out}", f"data.cache_dir={out.parent}/loong-data", "optim.lr=3e-4", "optim.min_lr=3e-5",
        f"optim.warmup_steps={args.warmup}", "train.dtype=bf16", *model_overrides, *args.loong_extra, *variant,
    ]  # fmt: skip


def run_loong(args, out: Path, variant: list[str]) -> tuple[list[float], float, list[int] | None]:
    """Step times after warm-up, peak memory, and each step's batch digest (None with DP > 1)."""
    cmd = loong_command(args, out, variant)
    print("loong:", " ".join(cmd[cmd.index("loong_train") + 1 :]), flush=True)
    train = run_train_app(cmd, out, label="loong run")
    # variants start from the same seed on the same batches: their losses show what a precision lever costs
    losses = [r["loss"] for r in train]
    print(f"  loss: step 1 {losses[0]:.4f}, last step {losses[-1]:.4f}, "
          f"mean of the last {min(5, len(losses))} {sum(losses[-5:]) / len(losses[-5:]):.4f}", flush=True)  # fmt: skip
    digests = [r.get("step_digest") for r in train]
    return ([r["step_time_s"] for r in train if r["step"] > args.warmup], max(r["peak_mem_gib"] for r in train),
            None if None in digests else digests)  # fmt: skip


def same_samples(digests: dict[str, list[int] | None]) -> str:
    """The line stating that every stack trained on the same batches (loong_data.batch_digest of
    each step's token ids); exits naming the first stack and step that differ (same_data)."""
    known = [StackCounts(name, [{"digest": d} for d in steps]) for name, steps in digests.items() if steps is not None]
    unknown = [name for name, steps in digests.items() if steps is None]
    if len(known) < 2:
        return f"same samples: not checked ({len(known)} stack(s) report batch digests; DP > 1 reports none)"
    check_same_data(known)
    left = f"; not reported by {', '.join(unknown)}" if unknown else ""
    return f"same samples: the batch digests of all {len(known[0].counts)} steps agree across {len(known)} stacks{left}"


def dp_size(args) -> int:
    return args.nproc // args.tp


def row_text(args, flops_per_token: float, name: str, step_s: float, peak_gib: float | None) -> str:
    """One table row: median step, tokens/s of the whole step, MFU per GPU, peak memory."""
    tps = args.mbs * args.seq * dp_size(args) / step_s
    peak = f"{peak_gib:9.1f}" if peak_gib is not None else f"{'-':>9}"
    return f"{name:<60} {step_s:8.3f} {tps:10,.0f} {flops_per_token * tps / (PEAK * args.nproc):6.3f} {peak}"


def hf_worker(args) -> None:
    """Runs in its own process: train HF LlamaForCausalLM, print one JSON line of step times."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from loong_data import (
        DistributedBatchSampler,
        PackedTextDataset,
        collate,
        default_corpus,
        default_tokenizer,
        load_tokenizer,
        prepare_text_dataset,
    )
    from loong_data.step_data import batch_digest

    f = foundation(args.model, args.model_override)
    rs = f.rope_scaling
    config = LlamaConfig(
        vocab_size=f.vocab_size, hidden_size=f.hidden_size, intermediate_size=f.ffn_hidden_size,
        num_hidden_layers=f.num_layers, num_attention_heads=f.num_attention_heads,
        num_key_value_heads=f.query_groups, head_dim=f.head_dim, max_position_embeddings=f.max_position_embeddings,
        rope_theta=f.rotary_base, rms_norm_eps=f.norm_epsilon, tie_word_embeddings=f.tie_word_embeddings,
        rope_scaling=None if rs is None else {
            "rope_type": "llama3", "factor": rs.factor, "low_freq_factor": rs.low_freq_factor,
            "high_freq_factor": rs.high_freq_factor, "original_max_position_embeddings": rs.original_max_position_embeddings,
        },
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    dtype = torch.float32 if args.hf_mode == "amp" else torch.bfloat16
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU only to smoke-test this script
    model = LlamaForCausalLM(config).to(device, dtype=dtype)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=device == "cuda")
    tok = load_tokenizer(default_tokenizer())
    corpus = prepare_text_dataset(default_corpus(), tok, Path(args.workdir) / "data", progress=False)
    data = PackedTextDataset(corpus.train, args.seq)
    sampler = iter(DistributedBatchSampler(len(data), micro_batch_size=args.mbs, num_microbatches=1,
                                           dp_rank=0, dp_size=1, seed=1234))  # fmt: skip
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times, digests = [], []
    for _ in range(args.steps):
        batch = collate([data[i] for i in next(sampler)[0]])
        digests.append(batch_digest([batch]))
        tokens = batch["tokens"].to(device, non_blocking=True)
        sync()
        t0 = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=args.hf_mode == "amp"):
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        sync()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0
    print(json.dumps({"step_times": times[args.warmup :], "peak_gib": peak, "digests": digests}))


def run_hf(args, mode: str, workdir: str) -> tuple[list[float], float, list[int]]:
    cmd = [sys.executable, __file__, "--worker", "hf", "--hf-mode", mode, "--workdir", workdir,
           f"--model={args.model}", f"--seq={args.seq}", f"--mbs={args.mbs}", f"--steps={args.steps}",
           f"--warmup={args.warmup}", "--model-override", *args.model_override]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        print(proc.stderr[-6000:], file=sys.stderr)
        raise SystemExit(f"hf run ({mode}) failed ({proc.returncode})")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return result["step_times"], result["peak_gib"], result["digests"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama3.2-1b")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--mbs", type=int, default=2)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--hf-modes", nargs="*", default=["amp"], choices=["amp", "bf16"],
                   help="amp: fp32 weights + bf16 autocast (Loong's numerics); bf16: bf16 weights and optimizer")
    p.add_argument("--skip-loong", action="store_true")
    p.add_argument("--loong-extra", nargs="*", default=[], help="extra overrides for the Loong run")
    p.add_argument("--variants", nargs="*", default=["loong="],
                   help="Loong runs: label=override,override (label= : no extra overrides)")
    p.add_argument("--model-override", nargs="*", default=[], help="model overrides, e.g. foundation.num_layers=4")
    p.add_argument("--nproc", type=int, default=1, help="GPUs of each Loong run (torchrun when > 1)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the Loong runs (with sequence parallelism)")
    p.add_argument("--worker", choices=["hf"], help=argparse.SUPPRESS)
    p.add_argument("--hf-mode", default="amp", help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.nproc < 1 or args.tp < 1 or args.nproc % args.tp:
        p.error(f"--tp {args.tp} must divide --nproc {args.nproc} (both >= 1)")
    if args.nproc > 1 and args.hf_modes:
        p.error("HF transformers runs on one GPU here: with --nproc > 1 pass --hf-modes with no value")
    return args


def main() -> None:
    args = parse_args()
    if args.worker == "hf":
        return hf_worker(args)
    f = foundation(args.model, args.model_override)
    fpt = f.flops_per_token(args.seq)  # the model's own count (loong-models)
    rows, loong_rows, failed, digests = [], 0, [], {}
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_loong:
            for label, variant in parse_variants(args.variants):
                name = " ".join(["loong", label, *args.loong_extra])
                try:
                    times, peak, digests[name] = run_loong(args, Path(tmp) / f"loong-{label}", variant)
                except SystemExit as e:  # e.g. out of memory at this micro-batch: the other variants still count
                    print(f"{name}: {e}", flush=True)
                    failed.append(name)
                    continue
                rows.append((name, statistics.median(times), peak))
                loong_rows += 1
                print("  " + row_text(args, fpt, *rows[-1]), flush=True)  # a run cut short keeps what finished
        for mode in args.hf_modes:
            name = f"hf transformers ({mode}, sdpa)"
            try:
                times, peak, digests[name] = run_hf(args, mode, tmp)
            except SystemExit as e:
                print(f"{name}: {e}", flush=True)
                failed.append(name)
                continue
            rows.append((name, statistics.median(times), peak))
            print("  " + row_text(args, fpt, *rows[-1]), flush=True)
    import torch

    print(f"\n{args.model} {' '.join(args.model_override)}: {f.num_parameters() / 1e9:.3f}B params, seq {args.seq}, "
          f"micro-batch {args.mbs}, {args.nproc} x {torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}"
          f"{f' (TP {args.tp}, DP {dp_size(args)}; MFU per GPU)' if args.nproc > 1 else ''}, "
          f"median of {args.steps - args.warmup} steps after {args.warmup} warm-up")  # fmt: skip
    from loong_kernels.tilelang_support import tilelang_importable

    # the fused output loss's speed depends on it (without it: the chunked torch reference)
    print(f"TileLang kernels: {'available' if tilelang_importable() else 'tilelang does not import (torch references)'}")
    print(f"{'stack':<60} {'step s':>8} {'tokens/s':>10} {'MFU':>6} {'peak GiB':>9}")
    for row in rows:
        print(row_text(args, fpt, *row))
    for name in failed:
        print(f"{name:<60} {'failed (see its stderr above)':>36}")
    if loong_rows and len(rows) > loong_rows:  # each Loong run against the first HF run
        base_name, base = rows[loong_rows][0], rows[loong_rows][1]
        for name, step, _ in rows[:loong_rows]:
            print(f"{name} / {base_name}: {base / step:.3f}x tokens/s")
    if loong_rows > 1:  # each variant against the first
        for name, step, _ in rows[1:loong_rows]:
            print(f"{name} / {rows[0][0]}: {rows[0][1] / step:.3f}x tokens/s")
    print(same_samples(digests))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
