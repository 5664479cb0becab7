"""torchrun worker: the tiny VLM (fp32, gloo) under context parallelism against one process.

Usage: ``torchrun --nproc-per-node N vlm_cp_worker.py OUT.json LAYOUT...`` with LAYOUT like
``cp2``, ``cp4``, ``cp2-a2a``, ``cp2-tp2-sp``, ``cp2-dp2``; ``-qwen3vl`` runs tiny-qwen3-vl
(DeepStack features, interleaved multimodal RoPE) instead of tiny-vlm. The micro-batches are real bundled
samples packed THD (every sample padded to a multiple of 8 tokens, so that CP=2 and CP=4 cut them):
text only, one image, five images of different sizes, an image with a video. The reference runs
with tp = pp = cp = 1 and every rank computing every micro-batch (the one-process numbers); each
layout starts from the reference's weights and trains STEPS optimizer steps through the train
app's forward step (``lm_forward_step``: the CP split, every image encoded on every CP rank,
vision embeddings and multimodal positions cut with the tokens), megatron's schedule, DDP and
the optimizer. A ``dp2`` layout gives DP rank ``d`` the micro-batches ``d, d + 2, ...``. Every
step's loss and every parameter's gradient (gathered to full size over TP) are compared with the
reference; rank 0 writes the largest differences to OUT.json.
"""

from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from loong_data.multimodal import collate_multimodal
from loong_data.testing import bundled_samples_by_media, small_vision_processor
from loong_models import build_model, build_transformer_config, fusion_fields, load_model_config
from loong_parallel import (
    OptimConfig,
    ParallelConfig,
    build_model_chunks,
    build_optimizer,
    initialize_model_parallel,
    runtime_transformer_fields,
    train_step,
    unwrap,
)
from loong_parallel.forward import lm_forward_step
from loong_parallel.testing import full_grads, tp_shard
from loong_xpu import get_accelerator, redirect_cuda

STEPS, SEQ, SEGMENT = 3, 512, 8


def parse(layout: str) -> tuple[ParallelConfig, str]:
    """(the layout, the zoo model)."""
    kw: dict = {"cp_comm_type": "a2a" if "a2a" in layout else "p2p", "sequence_parallel": "sp" in layout.split("-")}
    for part in layout.split("-"):
        for key in ("cp", "tp", "dp"):
            if part.startswith(key) and part[len(key) :].isdigit():
                kw[key] = int(part[len(key) :])
    kw.pop("dp", None)  # the rest of the world
    return ParallelConfig(**kw), "tiny-qwen3-vl" if "qwen3vl" in layout else "tiny-vlm"


def microbatches(out_dir: Path, model: str) -> list[dict]:
    """Text only, one image, five images of different sizes (two samples), an image and a video."""
    e = load_model_config(model).image_encoder
    processor = small_vision_processor(e.patch_size, e.temporal_patch_size, e.spatial_merge_size)
    _, by_media = bundled_samples_by_media(out_dir / "shards", processor, SEQ)
    packs = [[by_media[(0, 0)][0], by_media[(0, 0)][1]], [by_media[(1, 0)][0]],
             [by_media[(4, 0)][0], by_media[(1, 0)][1]], [by_media[(1, 1)][0]]]  # fmt: skip
    return [collate_multimodal(p, processor, segment_multiple=SEGMENT) for p in packs]


def run_layout(pcfg: ParallelConfig, model_name: str, accel, batches: list[dict], weights: dict | None = None):
    """(per-step losses, per-step gradients by name, initial weights by name) of one layout."""
    initialize_model_parallel(pcfg, dist.get_world_size())
    model_parallel_cuda_manual_seed(0)
    torch.manual_seed(0)
    cfg = load_model_config(model_name, ["layer_backend=local"])
    tconfig = build_transformer_config(cfg.foundation, **fusion_fields("local"),
                                       **runtime_transformer_fields(pcfg, dtype=torch.float32, device_type="cpu"))  # fmt: skip

    def provider(pre_process, post_process, vp_stage):
        return build_model(cfg, tconfig, device_type="cpu", pre_process=pre_process, post_process=post_process,
                           vp_stage=vp_stage)  # fmt: skip

    chunks = build_model_chunks(provider, pcfg, tconfig, accel)
    model = unwrap(chunks[0])
    if weights is None:  # the reference
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    else:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(tp_shard(model, n, p, weights[n]))
    optimizer, scheduler = build_optimizer(OptimConfig(lr=1e-3, warmup_steps=0, schedule="constant"), pcfg,
                                           chunks, dtype=torch.float32, total_steps=STEPS)  # fmt: skip
    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    # the reference: every micro-batch on every rank
    mine = batches if pcfg.cp == 1 and pcfg.tp == 1 else batches[dp_rank::dp]
    losses, grads = [], []
    for _ in range(STEPS):
        result = train_step(partial(lm_forward_step, accel.device()), iter(mine), chunks, optimizer, scheduler,
                            num_microbatches=len(mine), seq_length=SEQ, micro_batch_size=1, device=accel.device())  # fmt: skip
        losses.append(result.loss)
        grads.append(full_grads(model))
    mpu.destroy_model_parallel()
    return losses, grads, weights


def main() -> None:
    out_path, layouts = Path(sys.argv[1]), sys.argv[2:]
    accel = get_accelerator("cpu")
    with redirect_cuda(accel):
        dist.init_process_group("gloo")
        report, refs = {}, {}
        for layout in layouts:
            pcfg, model = parse(layout)
            if model not in refs:
                batches = microbatches(out_path.parent, model)
                refs[model] = (batches, *run_layout(ParallelConfig(), model, accel, batches))
            batches, ref_losses, ref_grads, weights = refs[model]
            losses, grads, _ = run_layout(pcfg, model, accel, batches, weights)
            for g, r in zip(grads, ref_grads):
                assert g.keys() == r.keys(), sorted(set(g) ^ set(r))
            report[layout] = {
                "losses": losses, "ref_losses": ref_losses,
                "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
                "max_grad_diff": max((g[k] - r[k]).abs().max().item() for g, r in zip(grads, ref_grads) for k in g),
                "max_grad": max(v.abs().max().item() for r in ref_grads for v in r.values()),
                "vision_grad": sum(v.abs().sum().item() for k, v in ref_grads[0].items() if k.startswith("image_")),
                "params": len(grads[0]),
                "media": [int(b["image_grid_thw"].shape[0]) + int(b["video_grid_thw"].shape[0]) for b in batches],
            }  # fmt: skip
        if dist.get_rank() == 0:
            out_path.write_text(json.dumps(report, indent=1))
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
