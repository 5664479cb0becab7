"""torchrun worker: the Wan DiT (wan-tiny, fp32) under context-parallel layouts against one process.

Usage: ``torchrun --nproc-per-node N wan_cp_worker.py OUT.json LAYOUT...`` with LAYOUT like
``cp2``, ``cp4``, ``cp2-a2a``, ``cp2-tp2-sp``. The reference runs with tp = cp = 1 (every rank
computes the whole global batch). Each layout then runs the same weights and batches for STEPS
optimizer steps through the train app's pieces: ``DiffusionModel``'s forward step (flow matching,
this CP rank's part of the tokens), megatron's schedule, DDP and ``finalize_model_grads`` (which
sums gradients and sample counts over DP x CP), then plain SGD on every rank's shards. Per step,
the loss and every parameter's gradient (gathered to full size over TP) are compared with the
reference's; so is, before training, the velocity for one timestep per latent token (Wan2.2
TI2V's modulation, split with the tokens), gathered over CP. Rank 0 writes the largest
differences to OUT.json.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from loong_models import load_model_config
from loong_models.diffusion.tokens import patch_tokens
from loong_parallel import (
    DiffusionModel,
    ParallelConfig,
    build_model_chunks,
    initialize_model_parallel,
    unwrap,
)
from loong_parallel.testing import full_grads, tp_shard
from loong_xpu import get_accelerator, redirect_cuda

STEPS, MICROBATCHES, MICRO, LR = 2, 2, 2, 0.5
LATENTS = (4, 2, 8, 12)  # channels, frames, height, width: 2 x 4 x 6 = 48 patch tokens
TEXT = 7


def parse(layout: str) -> ParallelConfig:
    kw: dict = {"cp_comm_type": "a2a" if "a2a" in layout else "p2p", "sequence_parallel": "sp" in layout.split("-")}
    for part in layout.split("-"):
        for key in ("cp", "tp"):
            if part.startswith(key) and part[len(key) :].isdigit():
                kw[key] = int(part[len(key) :])
    return ParallelConfig(**kw)


def batches(step: int, text_dim: int) -> list[dict]:
    """The step's micro-batches: latents, text embeddings and sample ids (the noise follows the ids)."""
    g = torch.Generator().manual_seed(100 + step)
    out = []
    for m in range(MICROBATCHES):
        ids = torch.arange(MICRO) + (step * MICROBATCHES + m) * MICRO
        out.append({"latents": torch.randn(MICRO, *LATENTS, generator=g), "sample_ids": ids,
                    "context": torch.randn(MICRO, TEXT, text_dim, generator=g)})  # fmt: skip
    return out


def step(kind: DiffusionModel, chunks, batch: list[dict]) -> tuple[float, dict[str, torch.Tensor]]:
    """One forward / backward over the global batch: (mean loss, full gradients); then SGD."""
    for chunk in chunks:
        chunk.zero_grad_buffer()
    outputs = get_forward_backward_func()(
        forward_step_func=kind.forward_step(torch.device("cpu")), data_iterator=iter(batch), model=chunks,
        num_microbatches=len(batch), seq_length=1, micro_batch_size=MICRO, forward_only=False,
    )  # fmt: skip
    total = torch.zeros(2, dtype=torch.float64)
    if mpu.get_tensor_model_parallel_rank() == 0 and mpu.get_data_parallel_rank() == 0:
        for o in outputs:
            total += o["lm loss"].double()
    dist.all_reduce(total)
    model = unwrap(chunks[0])
    grads = full_grads(model)
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(LR * p.main_grad)
    return float(total[0] / total[1]), grads


@torch.no_grad()
def per_token_velocity(model, cfg) -> torch.Tensor:
    """The velocity with one timestep per latent token, as patch tokens gathered over CP."""
    g = torch.Generator().manual_seed(5)
    latents, context = torch.randn(MICRO, *LATENTS, generator=g), torch.randn(MICRO, TEXT, cfg.text_dim, generator=g)
    tokens = LATENTS[1] * LATENTS[2] * LATENTS[3] // cfg.patch_volume
    model.eval()
    out = model(latents, torch.rand(MICRO, tokens, generator=g) * 1000, context)
    model.train()
    cp = mpu.get_context_parallel_world_size()
    if cp == 1:
        return patch_tokens(out, cfg.patch_size)
    parts = [torch.empty_like(out) for _ in range(cp)]
    dist.all_gather(parts, out.contiguous(), group=mpu.get_context_parallel_group())
    return torch.cat(parts, dim=1)


def run_layout(pcfg: ParallelConfig, accel, weights: dict | None) -> tuple[list, list, dict, torch.Tensor]:
    """(losses, gradients per step, initial weights, per-token-timestep velocity) of one layout."""
    initialize_model_parallel(pcfg, dist.get_world_size())
    model_parallel_cuda_manual_seed(0)
    torch.manual_seed(0)
    cfg = load_model_config("wan-tiny", ["layer_backend=local", "diffusion.recompute=keep_attention"])
    kind = DiffusionModel.from_config(cfg, "cpu", seed=3)
    tconfig = kind.transformer_config(pcfg, dtype=torch.float32, device_type="cpu")
    chunks = build_model_chunks(kind.provider(tconfig, pcfg, device_type="cpu"), pcfg, tconfig, accel)
    model = unwrap(chunks[0])
    assert model.cp == pcfg.cp and model.sp == pcfg.sequence_parallel, (model.cp, model.sp)  # the layout reached the DiT
    with torch.no_grad():
        if weights is None:
            weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        for n, p in model.named_parameters():
            p.copy_(tp_shard(model, n, p, weights[n]))
    velocity = per_token_velocity(model, cfg.diffusion)
    losses, grads = [], []
    for s in range(STEPS):
        loss, g = step(kind, chunks, batches(s, cfg.diffusion.text_dim))
        losses.append(loss)
        grads.append(g)
    mpu.destroy_model_parallel()
    return losses, grads, weights, velocity


def main() -> None:
    out_path, layouts = sys.argv[1], sys.argv[2:]
    accel = get_accelerator("cpu")
    with redirect_cuda(accel):
        dist.init_process_group("gloo")
        ref_losses, ref_grads, weights, ref_velocity = run_layout(ParallelConfig(), accel, None)
        report = {}
        for layout in layouts:
            losses, grads, _, velocity = run_layout(parse(layout), accel, weights)
            diffs = []
            for got, want in zip(grads, ref_grads):
                assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
                diffs.append(max((got[k] - want[k]).abs().max().item() for k in got))
            report[layout] = {"losses": losses, "ref_losses": ref_losses, "params": len(grads[0]),
                              "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
                              "max_grad_diff": max(diffs),
                              "per_token_velocity_diff": (velocity - ref_velocity).abs().max().item(),
                              "max_grad": max(v.abs().max().item() for v in ref_grads[0].values())}  # fmt: skip
        if dist.get_rank() == 0:
            with open(out_path, "w") as f:
                json.dump(report, f, indent=1)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
