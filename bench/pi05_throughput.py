"""Loong vs LeRobot: Pi0.5 training throughput on one GPU, in one run.

Both sides train Pi0.5 at the same shape (default: full, SigLIP So400m/14 @ 224 + Gemma 2B +
Gemma 300M action expert, horizon 50, random init: speed does not depend on the weights) on the
same samples: the bundled Metaworld episodes through the train app's data path
(``data.kind=lerobot``: frames resized to 224, prompt = task + discretised state, 200 tokens,
quantile-normalised action chunks). Loong runs the real train app (``--config-name pi05``,
megatron DDP + distributed optimizer, ``train.dtype=bf16``: bf16 compute, fp32 master weights).
LeRobot runs its own ``PI05Policy`` (``dtype="bfloat16"``: bf16 weights, the vision tower and
norms fp32) under bf16 autocast, with the step of ``lerobot_train.update_policy``: forward, backward,
``clip_grad_norm_`` (1.0), the optimizer and scheduler of the policy's presets (AdamW, betas
0.9/0.95, wd 0.01; cosine with warm-up), ``loss.item()``; Loong's AdamW uses the same betas,
weight decay and clipping. Each side runs in its own process; the figures are the medians over
the steps after warm-up.

    python bench/pi05_throughput.py                          # full shape, batch 8, 20 steps
    python bench/pi05_throughput.py --batch 4 --steps 30 --warmup 5
    python bench/pi05_throughput.py --batch 4 --rounds 2 --variant base --variant whole \
        model.embodied.compile_scope=policy                  # A, B, LeRobot, A, B, LeRobot

``--variant NAME [OVERRIDES...]`` (repeatable) runs several Loong configurations (each its own
train-app run, on top of ``--loong-extra``) in one invocation; ``--rounds N`` repeats (every
variant, then the reference) N times, alternating the stacks on the same samples. A variant whose
run fails is named with its error and left out of every round; the others go on. The table has
each run's median and its round's ratio; the headline is the ratio of the per-stack medians over
the steps of all rounds (step times on a lent GPU swing by 25-40% between runs).

Before any figure the script asserts that both sides trained on the same data at every step: the
same sample count and the same digest of prompt tokens, actions and sample ids (each side counts
its own: Loong's metrics.jsonl, the LeRobot worker's batches).

``--reference transcription`` swaps LeRobot's package for ``loong_models``' transcription of its
Pi0.5 (``lerobot_reference``, the parity tests' reference: parameters fp32 under bf16 autocast,
torch AdamW with the preset's values, no scheduler). The default test run uses it at the tiny
shape on CPU: the ``lerobot`` wheels that ship Pi0.5 pin ``torch < 2.12`` (not installable next to
the workspace's torch), and LeRobot's Gemma variant table has no tiny shape. The GPU figure
uses the real package (``--reference lerobot``, the default).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from train_app import run_train_app  # noqa: E402

LR, BETAS, EPS, WD, CLIP = 2.5e-5, (0.9, 0.95), 1e-8, 0.01, 1.0  # LeRobot's PI05Config optimizer preset


def train_overrides(args) -> list[str]:
    """The train-app overrides of the benchmark job; the LeRobot worker composes the same config to
    build the same batches."""
    return [f"model={args.model}", f"train.micro_batch_size={args.batch}", f"train.global_batch_size={args.batch}",
            f"train.dtype={args.dtype}", f"train.device={args.device}", "train.eval_iters=0", *args.loong_extra]  # fmt: skip


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    from loong_train.main import to_config

    with initialize_config_module("loong_train.configs", version_base=None):
        return to_config(hydra_compose("pi05", overrides=overrides))


@dataclass
class Row:
    name: str
    step_times: list[float]
    peak_gib: float
    counts: list[dict]  # per step: samples, digest (counted by the stack itself)


def run_loong(args, overrides: list[str], out: Path) -> Row:
    cmd = [sys.executable, "-m", "loong_train", "--config-name=pi05", *overrides, f"train.steps={args.steps}",
           "train.eval_interval=0", "train.save_final=false", "train.tensorboard=false", "train.progress=false",
           f"train.output_dir={out}", f"optim.lr={LR}", f"optim.min_lr={LR / 10}", f"optim.warmup_steps={args.warmup}",
           f"optim.beta1={BETAS[0]}", f"optim.beta2={BETAS[1]}", f"optim.eps={EPS}", f"optim.weight_decay={WD}",
           f"optim.clip_grad={CLIP}"]  # fmt: skip
    print("loong:", " ".join(cmd[2:]), flush=True)
    rows = run_train_app(cmd, out, label="loong run")
    counts = [{"samples": r["step_samples"], "digest": r["step_digest"]} for r in rows]
    return Row("loong (train app, megatron DDP)", [r["step_time_s"] for r in rows],
               max(r.get("peak_mem_gib", 0.0) for r in rows), counts)  # fmt: skip


# --- the LeRobot side (runs in its own process) --------------------------------------------------


def lerobot_policy(e, camera_keys: list[str], state_dim: int, action_dim: int, device: str, bf16: bool):
    """LeRobot's PI05Policy at ``e``'s shape (its variant table: Gemma 2B + Gemma 300M, So400m);
    returns ``(policy, loss_fn(batch) -> loss, optimizer, scheduler)`` as lerobot_train builds them."""
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.pi05.configuration_pi05 import PI05Config
    from lerobot.policies.pi05.modeling_pi05 import PI05Policy, get_gemma_config

    for name, ours, variant in (("vlm", e.vlm, "gemma_2b"), ("expert", e.expert, "gemma_300m")):
        theirs = vars(get_gemma_config(variant))
        if any(getattr(ours, k) != v for k, v in theirs.items()):
            raise SystemExit(f"--reference lerobot: model.embodied.{name} is not LeRobot's {variant}: {theirs}")  # fmt: skip
    s = e.vision.image_size
    cfg = PI05Config(
        dtype="bfloat16" if bf16 else "float32", device=device, chunk_size=e.chunk_size, n_action_steps=e.chunk_size,
        max_state_dim=e.max_state_dim, max_action_dim=e.max_action_dim, tokenizer_max_length=e.tokenizer_max_length,
        image_resolution=(s, s),
        input_features={**{k: PolicyFeature(FeatureType.VISUAL, (3, s, s)) for k in camera_keys},
                        "observation.state": PolicyFeature(FeatureType.STATE, (state_dim,))},
        output_features={"action": PolicyFeature(FeatureType.ACTION, (action_dim,))},
    )  # fmt: skip
    policy = PI05Policy(cfg)
    opt = cfg.get_optimizer_preset().build(policy.get_optim_params())
    sched = cfg.get_scheduler_preset().build(opt, num_training_steps=1000)

    def loss_fn(mb: dict) -> object:
        # LeRobot's frames are in [0, 1] (its policy maps them to SigLIP's [-1, 1])
        batch = {k: (mb["images"][:, i] + 1) / 2 for i, k in enumerate(camera_keys)}
        batch.update({"observation.language.tokens": mb["tokens"], "observation.language.attention_mask": mb["token_mask"],
                      "action": mb["actions"][..., :action_dim]})  # fmt: skip
        return policy.forward({k: v.to(device, non_blocking=True) for k, v in batch.items()})[0]

    return policy, loss_fn, opt, sched


def transcription_policy(e, action_dim: int, device: str):
    """loong_models' transcription of LeRobot's Pi0.5 (see the module docstring), the same loss."""
    import torch

    from loong_models.embodied.pi05.flow import sample_time
    from loong_models.embodied.pi05.lerobot_reference import PI05Reference

    policy = PI05Reference(e).to(device)
    opt = torch.optim.AdamW(policy.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)

    def loss_fn(mb: dict) -> object:
        mb = {k: v.to(device, non_blocking=True) for k, v in mb.items()}
        actions, b = mb["actions"], mb["actions"].shape[0]
        noise, time_ = torch.randn_like(actions), sample_time(e, b).to(device)
        images = [mb["images"][:, i] for i in range(mb["images"].shape[1])]
        masks = [mb["image_masks"][:, i] for i in range(mb["images"].shape[1])]
        losses = policy(images, masks, mb["tokens"], mb["token_mask"], actions, noise, time_)
        return losses[..., :action_dim].mean()

    return policy, loss_fn, opt, None


def reference_worker(args) -> None:
    """Train the reference on the train app's batches; print one JSON line of step times and counts."""
    import torch

    from loong_data.step_data.lerobot import lerobot_digest
    from loong_train.trainer import run_data, step_layout

    cfg = compose(json.loads(args.overrides))
    device = "cuda" if args.device == "cuda" else "cpu"
    # the train app's data path as Loong gets it: prefetched, page-locked for a CUDA device
    data = run_data(cfg, step_layout(cfg, num_microbatches=1, device=torch.device(device)))
    ds, e = data.batcher.ds, cfg.model.embodied
    torch.manual_seed(0)
    bf16 = args.dtype == "bf16"
    if args.reference == "lerobot":
        policy, loss_fn, opt, sched = lerobot_policy(e, ds.camera_keys, data.batcher.state_dim,
                                                     data.batcher.action_dim, device, bf16)  # fmt: skip
    else:
        policy, loss_fn, opt, sched = transcription_policy(e, data.batcher.action_dim, device)
    policy.train()
    params = [p for p in policy.parameters() if p.requires_grad]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    steps, times, counts = data.train_steps(), [], []
    for _ in range(args.steps):
        sync()
        t0 = time.perf_counter()  # like the train app's step time: fetching the step's batch included
        (mb,) = next(steps)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
            loss = loss_fn(mb)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        loss.item(), grad_norm.item()
        counts.append({"samples": int(mb["actions"].shape[0]), "digest": lerobot_digest([mb])})
        sync()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0
    print(json.dumps({"step_times": times, "counts": counts, "peak_gib": peak,
                      "params": sum(p.numel() for p in policy.parameters())}))  # fmt: skip


def run_reference(args, overrides: list[str]) -> Row:
    cmd = [sys.executable, __file__, "--worker", "--reference", args.reference, "--overrides", json.dumps(overrides),
           f"--steps={args.steps}", f"--dtype={args.dtype}", f"--device={args.device}"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        print(proc.stderr[-6000:], file=sys.stderr)
        raise SystemExit(f"{args.reference} run failed ({proc.returncode})")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"   {args.reference}: {out['params']:,} parameters", flush=True)
    return Row(f"{args.reference} (PI05Policy + update_policy)" if args.reference == "lerobot"
               else "lerobot transcription (CPU smoke)", out["step_times"], out["peak_gib"], out["counts"])  # fmt: skip


def check_same_data(a: Row, b: Row) -> None:
    """Both stacks trained on the same samples at every step, or the comparison means nothing."""
    if len(a.counts) != len(b.counts):
        raise SystemExit(f"{a.name!r} ran {len(a.counts)} steps, {b.name!r} {len(b.counts)}")
    for step, (x, y) in enumerate(zip(a.counts, b.counts), 1):
        if x != y:
            raise SystemExit(f"{a.name!r} and {b.name!r} trained different data at step {step}: {x} != {y}")


def report(rounds: list[dict[str, Row]], ref_name: str, warmup: int, batch: int) -> dict:
    """``rounds``: per round, the stack name -> its run (the Loong variants, then ``ref_name``).
    Prints one row per run with the round's ratio to the reference, then per stack the median over
    the steps of all its rounds; the headline is the reference's median over the fastest variant's."""
    med = lambda times: statistics.median(times)  # noqa: E731
    print(f"{'run':<44} {'step s (med)':>12} {'samples/s':>10} {'peak GiB':>9} {'round ratio':>11}")
    for i, runs in enumerate(rounds, 1):
        ref_med = med(runs[ref_name].step_times[warmup:])
        for name, r in runs.items():
            m = med(r.step_times[warmup:])
            print(f"{name + f' #{i}':<44} {m:12.3f} {batch / m:10.2f} {r.peak_gib:9.1f} {ref_med / m:10.2f}x")
    pooled = {name: med([t for runs in rounds for t in runs[name].step_times[warmup:]]) for name in rounds[0]}
    loong = {name: t for name, t in pooled.items() if name != ref_name}
    for name, t in pooled.items():
        print(f"{name}: median over {len(rounds)} round(s) {t:.3f} s, {batch / t:.2f} samples/s"
              + ("" if name == ref_name else f", {pooled[ref_name] / t:.2f}x"))  # fmt: skip
    best = min(loong, key=loong.get)
    ratio = pooled[ref_name] / loong[best]
    print(f"loong / {ref_name.split(' ')[0]} samples/s: {ratio:.2f}x ({best}, medians over all rounds)")
    variants = {name: {"step_s": t, "ratio": pooled[ref_name] / t,
                       "round_ratios": [med(r[ref_name].step_times[warmup:]) / med(r[name].step_times[warmup:])
                                        for r in rounds]} for name, t in loong.items()}  # fmt: skip
    return {"loong_samples_per_s": batch / loong[best], "reference_samples_per_s": batch / pooled[ref_name],
            "ratio": ratio, "best": best, "steps_compared": len(rounds[0][best].step_times) - warmup,
            "rounds": len(rounds), "variants": variants}  # fmt: skip


def run_rounds(args, overrides: list[str], tmp: Path) -> tuple[list[dict[str, Row]], str]:
    """``--rounds`` rounds, each: every ``--variant`` (default: one Loong config) in turn, then the
    reference, all on the same samples (checked). Returns the rounds and the reference's name."""
    variants = [(v[0], v[1:]) for v in args.variant] or [("loong (train app, megatron DDP)", [])]
    names = [name for name, _ in variants]
    if len(set(names)) != len(names):
        raise SystemExit(f"--variant names must differ: {names}")
    rounds = []
    for rnd in range(args.rounds):
        runs = {}
        for name, extra in list(variants):
            try:
                runs[name] = run_loong(args, overrides + extra, tmp / f"loong-{len(runs)}-{rnd}")
            except SystemExit as e:  # one lever that cannot run must not cost the others' figures
                if len(variants) == 1:
                    raise
                print(f"   {name} #{rnd + 1}: {e}; variant {name!r} left out of every round", flush=True)
                variants.remove((name, extra))
                for earlier in rounds:
                    earlier.pop(name, None)
                continue
            _progress(runs[name], f"{name} #{rnd + 1}", args.warmup)
        ref = run_reference(args, overrides)
        _progress(ref, f"{ref.name} #{rnd + 1}", args.warmup)
        for row in runs.values():
            check_same_data(row, ref)
        if ref.name in runs:
            raise SystemExit(f"--variant name {ref.name!r} is the reference's")
        rounds.append({**runs, ref.name: ref})
    return rounds, ref.name


def _progress(row: Row, label: str, warmup: int) -> None:
    # each run's figure as soon as it is known (a command cut short by a time limit keeps them)
    print(f"   {label}: median step {statistics.median(row.step_times[warmup:]):.3f} s", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="pi05", help="pi05 (full shape) or pi05-tiny")
    p.add_argument("--batch", type=int, default=8, help="samples per step (one micro-batch) on the GPU")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the medians")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--reference", default="lerobot", choices=["lerobot", "transcription"])
    p.add_argument("--json", type=Path, help="also write the figures here")
    p.add_argument("--loong-extra", nargs="*", default=[], help="more train-app overrides for both sides")
    p.add_argument("--variant", nargs="+", action="append", default=[], metavar="NAME_THEN_OVERRIDES",
                   help="a Loong configuration: a name, then train-app overrides (Loong side only); repeatable")
    p.add_argument("--rounds", type=int, default=1,
                   help="rounds of (every Loong variant, then the reference), each a fresh run on the same samples")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--overrides", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return reference_worker(args)
    if args.steps <= args.warmup:
        raise SystemExit(f"--steps={args.steps} must exceed --warmup={args.warmup}")
    overrides = train_overrides(args)
    with tempfile.TemporaryDirectory() as tmp:
        rounds, ref_name = run_rounds(args, overrides, Path(tmp))
    figures = report(rounds, ref_name, args.warmup, args.batch)
    if args.json:
        args.json.write_text(json.dumps(figures))


if __name__ == "__main__":
    main()
