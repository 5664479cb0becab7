"""The step of megatron's host-offloaded optimizer (HybridDeviceOptimizer, Loong's
optim.offload_fraction) as megatron builds it, against loong_xpu's manifest patches: the pinned
copy of the updated weights back to the GPU (loong_xpu.offload_copy_back), first with megatron's
one host AdamW per tensor, then with one per bucket of tensors (loong_xpu.offload_buckets), on one
GPU.

All variants build the optimizer the way megatron's precision-aware distributed optimizer does
(bf16 weights, fp32 gradients in ``decoupled_grad``, fp32 update, copies on side streams, fused
AdamW on the host) over the same weights and gradients; each step is timed to the GPU's end, the
median after --warmup steps is reported, and the weights must come out bit for bit the same.

    python bench/offload_copy_back.py                     # 0.78B parameters: one EP=4 rank of
                                                          # qwen3-30b-a3b x 4 layers
    python bench/offload_copy_back.py --params 1.55e9 --tensors 528  # one EP=2 rank's tensors
    python bench/offload_copy_back.py --params 1e8 --steps 4 --warmup 1

Measured on H200s, the same weights in every variant:
- one GPU, 16 host threads, 0.78B parameters, before the buckets: megatron 0.736 s a step, pinned
  copy-back 0.251 s;
- ``--params 1.55e9 --tensors 528 --threads 16`` in two processes at once, one per GPU of a 2-GPU
  host: megatron 1.509 / 1.492 s, pinned copy-back 0.533 / 0.656 s, pinned + buckets 0.432 / 0.429 s.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

import torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=float, default=0.78e9, help="parameters updated by the optimizer")
    p.add_argument("--tensors", type=int, default=64, help="tensors they are split into")
    p.add_argument("--offload-fraction", type=float, default=1.0, help="share of them updated on the host")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the median")
    p.add_argument("--threads", type=int, default=None, help="host threads for the update (default: all cores)")
    args = p.parse_args(argv)
    if args.steps <= args.warmup:
        p.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    if not 0 < args.offload_fraction <= 1:
        p.error(f"--offload-fraction {args.offload_fraction} must be in (0, 1]")
    if args.tensors < 1 or args.params < args.tensors:
        p.error(f"--params {args.params:g} must be at least --tensors {args.tensors}")
    return args


# name: (the manifest applied, elements per host optimizer; 0: one per tensor, as megatron builds them)
VARIANTS = {"megatron": (False, 0), "pinned copy-back": (True, 0), "pinned + buckets": (True, None)}


def run(args: argparse.Namespace, patched: bool, bucket: int | None) -> tuple[list[float], list[torch.Tensor]]:
    """Step times (s) and the final bf16 weights of one variant."""
    from loong_xpu import offload_buckets
    from loong_xpu.testing import hybrid_device_optimizer

    numel = int(args.params) // args.tensors
    g = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(numel, generator=g, device="cuda").bfloat16()) for _ in range(args.tensors)]
    default = offload_buckets.BUCKET
    offload_buckets.BUCKET = default if bucket is None else bucket  # read as the optimizer is built
    try:
        opt = hybrid_device_optimizer(params, args.offload_fraction, patched=patched, lr=1e-4)
    finally:
        offload_buckets.BUCKET = default
    times = []
    for _ in range(args.steps):
        for p in params:
            p.decoupled_grad = torch.randn(numel, generator=g, device="cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    weights = [p.detach().clone() for p in params]
    del opt, params
    gc.collect()
    torch.cuda.empty_cache()
    torch._C._host_emptyCache()  # the pinned host blocks too: each variant pins its own ~16 B a parameter
    return times, weights


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/offload_copy_back.py needs a CUDA GPU (megatron's HybridDeviceOptimizer copies on CUDA streams)")
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    print(f"{args.params / 1e9:.2f}B parameters in {args.tensors} tensors, offload fraction {args.offload_fraction}, "
          f"{torch.get_num_threads()} host threads, {torch.cuda.get_device_name()}", flush=True)  # fmt: skip
    results = {}
    for name, (patched, bucket) in VARIANTS.items():
        times, weights = run(args, patched, bucket)
        results[name] = (statistics.median(times[args.warmup :]), weights)
        print(f"{name:20s} median step {results[name][0]:.3f} s  (steps {', '.join(f'{t:.3f}' for t in times)})", flush=True)
    base, theirs = results["megatron"]
    same = all(torch.equal(a, b) for _, ours in results.values() for a, b in zip(theirs, ours, strict=True))
    print(f"same weights after {args.steps} steps in every variant: {same}")
    for name, (step_s, _) in list(results.items())[1:]:
        print(f"{name}: {base / step_s:.3f}x the speed of megatron's step ({base - step_s:.3f} s a step saved)")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
