"""Long sequences on GPUs: ChunkPipe against the unchunked run, and context-parallel scaling.

    python bench/long_context.py chunkpipe            # 1 GPU, llama3.2-1b, bf16
    python bench/long_context.py cp --gpus 4 --seq 131072
    python bench/long_context.py chunkpipe --smoke    # tiny model on the CPU (CI)

``chunkpipe``: the longest sequence that trains (one forward + backward of one sample, bf16
weights and gradients) without ChunkPipe, with full activation recompute (megatron's
``recompute=full``), against the longest with ChunkPipe (``--chunk`` tokens per chunk; it
recomputes every chunk but the last itself). Lengths double from ``--start`` until a run fails
with out-of-memory, then bisect. Each probe is its own process (an OOM leaves nothing behind).
Then tokens/s of both at ``--throughput-seq`` (targets: longest ratio >= 4, throughput ratio >=
0.9). The tokens are the bundled Shakespeare plays, concatenated and tokenized.

``cp``: the train app at ``parallel.cp=N`` on N GPUs with ``--seq`` tokens per sample, against
``parallel.cp=1`` on one GPU with ``--seq / N`` tokens: scaling efficiency = (tokens/s per GPU at
CP=N) / (tokens/s at CP=1) (target >= 0.85), both with full recompute.
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
from train_app import run_train_app  # noqa: E402

SMOKE = dict(model="tiny", layers=2, chunk=32, start=64, max_seq=128, throughput_seq=128, steps=2, warmup=1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["chunkpipe", "cp", "probe"])
    p.add_argument("--model", default="llama3.2-1b")
    p.add_argument("--layers", type=int, default=None, help="cut the model to this many layers")
    p.add_argument("--chunk", type=int, default=8192, help="ChunkPipe tokens per chunk")
    p.add_argument("--start", type=int, default=8192, help="first length of the search")
    p.add_argument("--max-seq", type=int, default=1 << 20, help="stop the search here")
    p.add_argument("--throughput-seq", type=int, default=32768)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--gpus", type=int, default=2, help="cp: the CP size (one GPU per CP rank)")
    p.add_argument("--seq", type=int, default=65536, help="cp: tokens per sample at CP=N")
    p.add_argument("--cp-comm-type", default="p2p", choices=["p2p", "a2a"])
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU, short lengths")
    p.add_argument("--mode", choices=["base", "chunkpipe"], help="probe: which run")
    p.add_argument("--probe-seq", type=int, help="probe: the length")
    p.add_argument("--chunk-attention", choices=["fused", "sdpa"], default="fused",
                   help="ChunkPipe attention: the layers' own (TE: the fused kernels of the base run) or torch SDPA")  # fmt: skip
    args = p.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    if args.what == "cp" and args.seq % (2 * args.gpus):
        p.error(f"--seq {args.seq} must be a multiple of 2 x --gpus")
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    return args


def longest_fitting(fits, start: int, max_seq: int, step: int, bisections: int = 3) -> int:
    """Largest length (a multiple of ``step``) for which ``fits(length)`` holds: doubling from
    ``start`` up to ``max_seq``, then ``bisections`` halvings of the gap to the first failure.
    0 when even ``start`` does not fit."""
    good, bad = 0, None
    n = start
    while n <= max_seq:
        if not fits(n):
            bad = n
            break
        good, n = n, n * 2
    for _ in range(bisections if bad is not None and good else 0):
        mid = (good + bad) // 2 // step * step
        if mid in (good, bad):
            break
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good


def corpus_tokens(n: int) -> list[int]:
    """The bundled plays, concatenated (repeated if needed) and tokenized: ``n`` token ids."""
    from loong_data import default_corpus, default_tokenizer, load_tokenizer

    tok = load_tokenizer(default_tokenizer())
    ids: list[int] = []
    files = sorted(default_corpus().glob("*.txt"))
    while len(ids) < n:
        for f in files:
            ids += tok.encode(f.read_text(encoding="utf-8"))
            if len(ids) >= n:
                break
    return ids[:n]


def probe_command(args, mode: str, seq: int) -> list[str]:
    keep = ["--model", args.model, "--chunk", str(args.chunk), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--chunk-attention", args.chunk_attention] + (["--layers", str(args.layers)] if args.layers else [])  # fmt: skip
    return [sys.executable, __file__, "probe", "--mode", mode, "--probe-seq", str(seq), *keep]


def run_probe(args, mode: str, seq: int) -> dict | None:
    """One probe in its own process; None when it ran out of memory."""
    env = dict(os.environ, LOONG_DEVICE="cpu") if args.smoke else None
    proc = subprocess.run(probe_command(args, mode, seq), capture_output=True, text=True, env=env)
    if proc.returncode:
        if "OutOfMemoryError" in proc.stderr or "out of memory" in proc.stderr:
            print(f"  {mode:9s} {seq:>8d} tokens: out of memory", flush=True)
            return None
        print(proc.stderr[-6000:], file=sys.stderr)
        raise SystemExit(f"probe {mode} at {seq} tokens failed ({proc.returncode})")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"  {mode:9s} {seq:>8d} tokens: {result['tokens_per_s']:.0f} tokens/s, "
          f"peak {result['peak_gib']:.2f} GiB", flush=True)  # fmt: skip
    return result


def chunkpipe_bench(args) -> dict:
    longest = {}
    for mode in ("base", "chunkpipe"):
        longest[mode] = longest_fitting(lambda n, m=mode: run_probe(args, m, n) is not None,
                                        args.start, args.max_seq, args.chunk)  # fmt: skip
    speed = {mode: run_probe(args, mode, args.throughput_seq) for mode in ("base", "chunkpipe")}
    report = {"longest": longest, "longest_ratio": longest["chunkpipe"] / max(longest["base"], 1),
              "throughput_seq": args.throughput_seq,
              "tokens_per_s": {m: r and r["tokens_per_s"] for m, r in speed.items()}}  # fmt: skip
    if all(speed.values()):
        report["throughput_ratio"] = speed["chunkpipe"]["tokens_per_s"] / speed["base"]["tokens_per_s"]
        report["loss"] = {m: r["loss"] for m, r in speed.items()}
    print(json.dumps(report, indent=1))
    return report


def _build(args, accel, chunkpipe: bool):
    import torch

    from loong_models import (
        build_model,
        build_transformer_config,
        fusion_fields,
        load_model_config,
        resolve_backend,
    )
    from loong_parallel import ParallelConfig, runtime_transformer_fields

    overrides = [f"foundation.num_layers={args.layers}"] if args.layers else []
    # ChunkPipe recomputes chunks itself; the baseline recomputes every layer (megatron's full)
    if not chunkpipe:
        overrides.append("+foundation.recompute=full")  # the zoo YAMLs leave recompute out
    cfg = load_model_config(args.model, overrides)
    dtype = torch.float32 if accel.device_type == "cpu" else torch.bfloat16
    backend = resolve_backend(cfg.layer_backend, accel.device_type)
    tconfig = build_transformer_config(
        cfg.foundation, **runtime_transformer_fields(ParallelConfig(), dtype=dtype, device_type=accel.device_type),
        **fusion_fields(backend),
    )  # fmt: skip
    return build_model(cfg, tconfig, device_type=accel.device_type).to(accel.device())


def probe(args) -> None:
    """Runs in its own process: ``--steps`` timed forward + backward passes of one sample."""
    import torch
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from loong_models.chunked import enable_chunkpipe
    from loong_parallel import ParallelConfig, init_distributed, initialize_model_parallel, shutdown
    from loong_parallel.chunkpipe import chunkpipe_forward_backward
    from loong_xpu import get_accelerator, redirect_cuda

    accel = get_accelerator(None)
    with redirect_cuda(accel):
        init_distributed(accel)
        initialize_model_parallel(ParallelConfig(), 1)
        model_parallel_cuda_manual_seed(0)
        device, seq, chunked = accel.device(), args.probe_seq, args.mode == "chunkpipe"
        model = _build(args, accel, chunked)
        ids = torch.tensor(corpus_tokens(seq + 1), device=device)[None]
        batch = {"tokens": ids[:, :-1], "labels": ids[:, 1:], "loss_mask": torch.ones(1, seq, device=device),
                 "position_ids": torch.arange(seq, device=device)[None]}  # fmt: skip
        state = enable_chunkpipe(model, fused_attention=args.chunk_attention == "fused") if chunked else None
        times, loss = [], 0.0
        for _ in range(args.warmup + args.steps):
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            if chunked:
                loss = chunkpipe_forward_backward(model, state, batch, args.chunk, device).loss_sum
            else:
                per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
                total = per_token.float().sum()
                total.backward()
                loss = float(total.detach())
            accel.synchronize()
            times.append(time.perf_counter() - t0)
        peak = accel.memory_stats().peak_allocated / 2**30
        print(json.dumps({"mode": args.mode, "seq": seq, "loss": loss / seq, "peak_gib": peak,
                          "chunk_attention": args.chunk_attention if chunked else None,
                          "tokens_per_s": seq / statistics.median(times[args.warmup:])}))  # fmt: skip
        shutdown()


def cp_command(args, cp: int, seq: int, out: Path) -> list[str]:
    run = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={cp}", "--standalone"]
    layers = [f"model.foundation.num_layers={args.layers}"] if args.layers else []
    return [*run, "-m", "loong_train", f"model={args.model}", *layers, f"data.seq_length={seq}",
            f"model.foundation.max_position_embeddings={max(seq, 131072)}", "+model.foundation.recompute=full",
            f"parallel.cp={cp}", f"parallel.cp_comm_type={args.cp_comm_type}", "train.micro_batch_size=1",
            "train.global_batch_size=1", f"train.steps={args.steps + args.warmup}", "train.eval_iters=0",
            "train.save_final=false", "train.tensorboard=false", "train.progress=false", "train.dtype=bf16",
            f"train.output_dir={out}", f"data.cache_dir={out}/data"]  # fmt: skip


def cp_bench(args) -> dict:
    rates = {}
    with tempfile.TemporaryDirectory() as tmp:
        for cp, seq in ((1, args.seq // args.gpus), (args.gpus, args.seq)):
            out = Path(tmp) / f"cp{cp}"
            rows = run_train_app(cp_command(args, cp, seq, out), out, label=f"cp={cp}")
            rates[cp] = statistics.median(r["tokens_per_s"] for r in rows if r["step"] > args.warmup)
            print(f"  cp={cp} seq={seq}: {rates[cp]:.0f} tokens/s ({rates[cp] / cp:.0f} per GPU)", flush=True)
    report = {"seq": args.seq, "gpus": args.gpus, "tokens_per_s": rates,
              "efficiency": rates[args.gpus] / args.gpus / rates[1]}  # fmt: skip
    print(json.dumps(report, indent=1))
    return report


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    {"chunkpipe": chunkpipe_bench, "cp": cp_bench, "probe": probe}[args.what](args)


if __name__ == "__main__":
    main()
