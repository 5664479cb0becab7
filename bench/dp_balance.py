"""DP load balancing: rank cost imbalance (simulated, any machine) and step time (real, GPUs), with
and without balancing, on a long-tailed length distribution like mixed multimodal data
(lognormal lengths plus a tail of samples at the maximum length).

Simulated (CPU is fine; a few seconds):

    uv run python bench/dp_balance.py sim
    uv run python bench/dp_balance.py sim --steps 50 --samples-per-rank 16 --tail 0.03 --max-length 16384

  For DP = 2, 4, 8 it draws ``--steps`` global batches, assigns them the way the sampler does
  (contiguous slices: "naive") and with the balancer (LPT + move/swap, token cap), and prints the
  mean max/mean rank cost and the imbalance (max/mean - 1), and the bound no assignment can beat
  (one rank holding only the costliest sample). Costs are the FLOP-based
  ``a*L + b*L^2`` of ``--model`` (a zoo name). Target of issue 5: balanced imbalance <= 5% where
  naive is >= 30%.

Real (4 GPUs, NCCL; the train app's packed path on the bundled corpus):

    uv run torchrun --standalone --nproc-per-node 4 bench/dp_balance.py real
    uv run torchrun --standalone --nproc-per-node 4 bench/dp_balance.py real --steps 40 -- train.micro_batch_size=8

  Trains the same job ``--rounds`` times with parallel.balance.enabled=false and as often with
  true, alternating (off, on, on, off, ...; same seed, same samples), and prints the median, mean
  and total step time after ``--skip`` warm-up steps, the rank imbalance the balancer predicted,
  tokens/s (total tokens / total time) and each run's final loss. Arguments after ``--`` are
  train-app overrides. Defaults: qwen3-0.6b (vocab cut to the bundled 8K tokenizer), packs of
  8192 tokens, 16 samples per rank, median sample 512 tokens, 5% of samples 8192 long. Target of
  issue 5: step time >= 15% lower with balancing on 4 GPUs. The same mode runs on CPU with gloo as
  a smoke test:

    LOONG_DEVICE=cpu uv run torchrun --standalone --nproc-per-node 4 bench/dp_balance.py real --tiny
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from loong_data import LogNormalLengths
from loong_parallel.balance import QuadraticCost, imbalance, plan_balance, rank_loads

REAL_DEFAULTS = [
    "model=qwen3-0.6b", "model.foundation.vocab_size=8192", "data.packing=thd", "data.seq_length=8192",
    "data.thd.median_length=512", "data.thd.sigma=1.0", "data.thd.long_fraction=0.05",
    "train.micro_batch_size=4", "train.global_batch_size=64", "train.eval_iters=0", "train.eval_interval=0",
    "train.tensorboard=false", "train.progress=false", "optim.warmup_steps=5",
]  # fmt: skip
TINY = [
    "model=tiny", "model.foundation.num_layers=2", "model.foundation.hidden_size=64",
    "model.foundation.ffn_hidden_size=128", "model.foundation.kv_channels=16", "data.seq_length=256",
    "data.thd.median_length=24", "data.thd.long_fraction=0.1",
]  # fmt: skip


def model_cost(name: str) -> tuple[QuadraticCost, str]:
    from loong_models import load_model_config

    f = load_model_config(name).foundation
    cost = QuadraticCost.from_flops(num_parameters=f.num_parameters(), num_layers=f.num_layers,
                                    attention_width=f.num_attention_heads * f.head_dim)
    return cost, f"{name} ({f.num_parameters() / 1e6:.0f}M params, {f.num_layers} layers)"


def simulate(args: argparse.Namespace) -> int:
    cost, described = model_cost(args.model)
    lengths_dist = LogNormalLengths(median=args.median, sigma=args.sigma, min_length=16, long_fraction=args.tail)
    print(f"cost: FLOPs of {described}; lengths: lognormal median {args.median} sigma {args.sigma}, "
          f"{args.tail:.0%} at {args.max_length}; {args.samples_per_rank} samples/rank, {args.steps} steps, "
          f"cap {args.cap_factor} x mean tokens/rank")
    print(f"{'DP':>3} {'naive max/mean':>15} {'naive imb':>10} {'balanced max/mean':>18} {'balanced imb':>13} "
          f"{'worst bal imb':>14} {'bound':>7} {'moved':>6} {'plan ms':>8}  target")
    ok = True
    for dp in (2, 4, 8):
        rng = np.random.default_rng(args.seed + dp)
        naive, balanced, bound, moved, ms = [], [], [], [], []
        for _ in range(args.steps):
            lengths = lengths_dist.sample(rng, args.samples_per_rank * dp, args.max_length)
            origin = np.repeat(np.arange(dp), args.samples_per_rank)
            cap = max(int(args.cap_factor * lengths.sum() / dp), int(lengths.max()))
            t0 = time.perf_counter()
            plan = plan_balance(lengths, origin, dp, cost, min_imbalance=args.min_imbalance, max_tokens=cap)
            ms.append(1e3 * (time.perf_counter() - t0))
            costs = cost(lengths)
            naive.append(imbalance(rank_loads(costs, origin, dp)))
            # No assignment beats one rank holding just the costliest sample.
            bound.append(max(0.0, costs.max() / (costs.sum() / dp) - 1))
            balanced.append(plan.imbalance)
            moved.append(float(np.mean(plan.assignment != origin)))
        n, b = float(np.mean(naive)), float(np.mean(balanced))
        met = b <= 0.05 and n >= 0.30
        ok &= met or n < 0.30
        verdict = "met" if met else ("n/a (naive < 30%)" if n < 0.30 else "MISSED")
        print(f"{dp:>3} {1 + n:>15.3f} {n:>10.1%} {1 + b:>18.3f} {b:>13.2%} {max(balanced):>14.2%} "
              f"{np.mean(bound):>7.2%} {np.mean(moved):>6.0%} {np.median(ms):>8.1f}  {verdict}")
    return 0 if ok else 2


def _step_rows(metrics: Path, skip: int) -> list[dict]:
    """The training rows of a run after ``skip`` warm-up steps (all of them if there are no more)."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line]
    train = [r for r in rows if r.get("split", "train") == "train"]
    return [r for r in train if r["step"] > skip] or train


def summarize(runs: list[list[dict]]) -> dict[str, float]:
    """One configuration over all its runs: step time median, mean and total, tokens/s as total
    tokens / total time, the planned imbalance, the final loss of each run (the same data, so the
    same losses up to summation order)."""
    rows = [r for run in runs for r in run]
    times = [r["step_time_s"] for r in rows]
    out = {"median_s": statistics.median(times), "mean_s": statistics.mean(times), "total_s": sum(times),
           "tokens_per_s": sum(r["tokens"] for r in rows) / sum(times), "losses": [run[-1]["loss"] for run in runs]}  # fmt: skip
    if "dp_imbalance_naive" in rows[0]:
        out["imb_naive"] = statistics.mean(r["dp_imbalance_naive"] for r in rows)
        out["imb_planned"] = statistics.mean(r["dp_imbalance"] for r in rows)
    return out


def run_order(rounds: int) -> list[bool]:
    """Balancing off/on in alternating order (off, on, on, off, off, on, ...): neither setting
    always runs first, on a warmer GPU or after the other has filled the caches."""
    return [flag for i in range(rounds) for flag in ((False, True) if i % 2 == 0 else (True, False))]


def real(args: argparse.Namespace, overrides: list[str]) -> int:
    from hydra import compose, initialize_config_dir

    import loong_train
    from loong_parallel import init_distributed, shutdown
    from loong_train.main import _setup_logging, to_config
    from loong_train.trainer import Trainer
    from loong_xpu import get_accelerator
    from loong_xpu.log import quiet_megatron

    quiet_megatron()
    _setup_logging()
    base = REAL_DEFAULTS + (TINY if args.tiny else []) + [f"train.steps={args.steps}"]
    config_dir = str(Path(loong_train.__file__).parent / "configs")
    is_main = int(os.environ.get("RANK", 0)) == 0
    # Both runs share the launch's process group (a trainer closes only the groups it created):
    # re-creating it after a teardown hangs in the env:// rendezvous.
    init_distributed(get_accelerator())
    runs: dict[str, list[list[dict]]] = {"naive": [], "balanced": []}
    for i, balanced in enumerate(run_order(args.rounds)):
        name = "balanced" if balanced else "naive"
        run_overrides = [*base, f"parallel.balance.enabled={str(balanced).lower()}",
                         f"train.output_dir={args.out}/{name}-{i}", "train.overwrite=true", *overrides]  # a re-run replaces it
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            cfg = to_config(compose(config_name="config", overrides=run_overrides))
        summary = Trainer(cfg).fit()
        if is_main:
            runs[name].append(_step_rows(summary.metrics_file, args.skip))
    shutdown()
    if not is_main:
        return 0
    results = {name: summarize(r) for name, r in runs.items()}
    naive, bal = results["naive"], results["balanced"]
    world = os.environ.get("WORLD_SIZE", "1")
    print(f"\nDP balancing, {world} processes, {args.rounds} runs each, alternating "
          f"({', '.join('on' if b else 'off' for b in run_order(args.rounds))}), steps > {args.skip}; "
          f"overrides: {' '.join(overrides) or '-'}")
    print(f"{'run':<10} {'median s':>9} {'mean s':>8} {'total s':>8} {'tokens/s':>10} {'imbalance (planned)':>20}  final losses")
    for name, r in results.items():
        imb = f"{r['imb_naive']:.1%} -> {r['imb_planned']:.1%}" if "imb_naive" in r else "-"
        print(f"{name:<10} {r['median_s']:>9.3f} {r['mean_s']:>8.3f} {r['total_s']:>8.2f} {r['tokens_per_s']:>10,.0f} "
              f"{imb:>20}  {' '.join(f'{x:.4f}' for x in r['losses'])}")
    for stat in ("median_s", "mean_s", "total_s"):
        print(f"step time reduction with balancing ({stat.removesuffix('_s')}): {1 - bal[stat] / naive[stat]:.1%}")
    print("target of issue 5 on 4 GPUs: >= 15%; on an oversubscribed CPU the figures mean nothing")
    return 0


def main() -> int:
    argv = sys.argv[1:]
    overrides = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("sim", help="simulated rank costs (any machine)")
    s.add_argument("--model", default="qwen3-0.6b", help="zoo model whose FLOPs give the cost coefficients")
    s.add_argument("--steps", type=int, default=20)
    s.add_argument("--samples-per-rank", type=int, default=32)
    s.add_argument("--median", type=float, default=400)
    s.add_argument("--sigma", type=float, default=1.0)
    s.add_argument("--tail", type=float, default=0.04, help="fraction of samples at --max-length")
    s.add_argument("--max-length", type=int, default=8192)
    s.add_argument("--cap-factor", type=float, default=1.5, help="token cap = this x mean tokens per rank")
    s.add_argument("--min-imbalance", type=float, default=0.0)
    s.add_argument("--seed", type=int, default=0)
    r = sub.add_parser("real", help="step time under torchrun (GPUs with NCCL, or CPU with gloo)")
    r.add_argument("--steps", type=int, default=30)
    r.add_argument("--skip", type=int, default=5, help="warm-up steps left out of every figure")
    r.add_argument("--rounds", type=int, default=2, help="runs of each setting, in alternating order")
    r.add_argument("--tiny", action="store_true", help="a tiny model and short packs (CPU smoke test)")
    r.add_argument("--out", default="runs/bench-dp-balance")
    args = p.parse_args(argv)
    return simulate(args) if args.mode == "sim" else real(args, overrides)


if __name__ == "__main__":
    sys.exit(main())
