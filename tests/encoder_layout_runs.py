"""Run under torchrun (gloo, 4 processes): the tiny VLM with its encoder at TP=1 trained with
parallel.encoder_layout=shared and another layout (sequence parallelism off and on), from the same
seed on the same micro-batches (real bundled samples: 0, 1 and 5 images of different sizes, a
video): hetero_dp at TP 2 x DP 2 (10 steps), decoupled at TP 2 x PP 2; then each with a frozen
encoder. Every rank compares the losses and every parameter's gradient of the two layouts (a later
stage's copy of the encoder against the first stage's), the grad norms and a final evaluation's
loss, counts the images its encoder encoded and whether any encoder backward ran; rank 0 writes
the results to argv[1] as JSON.

    torchrun --standalone --nproc-per-node 4 tests/encoder_layout_runs.py OUT.json [LAYOUT ...]
"""

import json
import sys
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from loong_data.testing import bundled_samples_by_media, small_vision_processor
from loong_models import build_model, build_transformer_config, fusion_fields, load_model_config
from loong_parallel import (
    OptimConfig,
    ParallelConfig,
    build_model_chunks,
    build_optimizer,
    eval_step,
    init_distributed,
    initialize_model_parallel,
    runtime_transformer_fields,
    train_step,
    unwrap,
)
from loong_parallel.component_groups import component_process_groups
from loong_parallel.encoder_layout import apply_encoder_layout, encoder_on_every_stage
from loong_parallel.forward import lm_forward_step
from loong_xpu import get_accelerator, redirect_cuda

STEPS, SEQ = 10, 512
LAYOUTS = {"hetero_dp": {}, "decoupled": {"pp": 2}}  # each beside shared, at TP 2 x (DP 2 | PP 2)
VISION = ("image_encoder.", "image_projector.")


def microbatches(out_dir: Path, dp_rank: int) -> list[dict]:
    """This DP rank's micro-batches: text only, one image, five images of different sizes (a
    4-digit sample + a photo), a video with an image (the "mixed" samples)."""
    e = load_model_config("tiny-vlm").image_encoder
    processor = small_vision_processor(e.patch_size, e.temporal_patch_size, e.spatial_merge_size)
    ds, by_media = bundled_samples_by_media(out_dir / "shards", processor, SEQ)
    pick = lambda m, i=0: by_media[m][dp_rank * 2 + i]  # noqa: E731
    packs = [[pick((0, 0))], [pick((1, 0))], [pick((4, 0)), pick((1, 0), 1)], [pick((1, 1))]]
    return [ds.collate(p) for p in packs]


class EncoderProbe:
    """Counts the images / clips the encoder encodes and the encoder backwards that run."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        self.images = self.backwards = 0
        encoder.register_forward_hook(self._forward)

    def _forward(self, module, args, output) -> None:
        self.images += int(args[1].shape[0])
        if output.requires_grad:
            output.register_hook(self._backward)

    def _backward(self, grad) -> None:
        self.backwards += 1


def run(accel, batches: list[dict], *, layout: str, sp: bool, freeze: bool = False, steps: int = STEPS,
        pp: int = 1) -> dict:  # fmt: skip
    pcfg = ParallelConfig(tp=2, pp=pp, sequence_parallel=sp, encoder_layout=layout)
    initialize_model_parallel(pcfg, dist.get_world_size())
    model_parallel_cuda_manual_seed(0)
    torch.manual_seed(0)
    # two LLM layers (one per pipeline stage at PP 2): the layouts differ in where the encoder runs
    overrides = ["layer_backend=local", "image_encoder.tensor_model_parallel_size=1", "foundation.num_layers=2",
                 *(["+image_encoder.freeze=true"] if freeze else [])]  # fmt: skip
    cfg = load_model_config("tiny-vlm", overrides)
    tconfig = build_transformer_config(cfg.foundation, **fusion_fields("local"),
                                       **runtime_transformer_fields(pcfg, dtype=torch.float32, device_type="cpu"))  # fmt: skip
    groups = component_process_groups(1)

    def provider(pre_process, post_process, vp_stage):
        model = build_model(cfg, tconfig, device_type="cpu",
                            pre_process=pre_process, post_process=post_process, vp_stage=vp_stage,
                            encoder_pg_collection=groups, encoder_on_every_stage=encoder_on_every_stage(layout))  # fmt: skip
        return apply_encoder_layout(model, layout, cfg, mpu.get_tensor_model_parallel_group())

    chunks = build_model_chunks(provider, pcfg, tconfig, accel)
    optimizer, scheduler = build_optimizer(OptimConfig(lr=1e-3, warmup_steps=0, schedule="constant"), pcfg,
                                           chunks, dtype=torch.float32, total_steps=STEPS)  # fmt: skip
    encoder = unwrap(chunks[0]).image_encoder  # None on later stages of the shared layout
    probe = EncoderProbe(encoder) if encoder is not None else EncoderProbe(torch.nn.Identity())
    losses, norms, grads, images = [], [], [], []
    for _ in range(steps):
        before = probe.images
        result = train_step(partial(lm_forward_step, accel.device()), iter(batches), chunks, optimizer, scheduler,
                            num_microbatches=len(batches), seq_length=SEQ, micro_batch_size=1, device=accel.device())  # fmt: skip
        losses.append(result.loss)
        norms.append(result.grad_norm)
        grads.append({n: p.main_grad.clone() for n, p in unwrap(chunks[0]).named_parameters() if p.requires_grad})
        images.append(probe.images - before)
    first_stage_vision = first_stage_vision_grads(grads)
    # the forward-only path (evaluation): the layout encodes without building the backward
    losses.append(eval_step(partial(lm_forward_step, accel.device()), iter(batches), chunks,
                            num_microbatches=len(batches), seq_length=SEQ, micro_batch_size=1, device=accel.device())[0])  # fmt: skip
    mpu.destroy_model_parallel()
    return {"losses": losses, "norms": norms, "grads": grads, "images": images, "backwards": probe.backwards,
            "first_stage_vision": first_stage_vision}  # fmt: skip


def first_stage_vision_grads(grads: list[dict]) -> list[dict]:
    """The encoder's and projector's gradients of the first stage's rank with this TP rank."""
    mine = [{k: v for k, v in g.items() if k.startswith(VISION)} for g in grads]
    pp_group = mpu.get_pipeline_model_parallel_group()
    box = [mine if mpu.is_pipeline_first_stage() else None]
    dist.broadcast_object_list(box, dist.get_process_group_ranks(pp_group)[0], group=pp_group)
    return box[0]


def compare(a: dict, b: dict) -> dict:
    """``a``: shared; ``b``: the other layout, whose later stages may hold copies of the encoder:
    those are compared with ``a``'s first stage's."""
    worst = 0.0
    for ga, gb, first in zip(a["grads"], b["grads"], a["first_stage_vision"]):
        extra = gb.keys() - ga.keys()
        assert ga.keys() <= gb.keys() and all(k.startswith(VISION) for k in extra), sorted(extra)[:5]
        ga = {**ga, **{k: first[k] for k in extra}}
        worst = max(worst, *((ga[k] - gb[k]).abs().max().item() for k in gb))
    return {"max_loss_diff": max(abs(x - y) for x, y in zip(a["losses"], b["losses"])), "max_grad_diff": worst,
            "max_norm_rel_diff": max(abs(x - y) / x for x, y in zip(a["norms"], b["norms"])), "norms": b["norms"],
            "num_params": len(a["grads"][0]), "losses": b["losses"]}  # fmt: skip


def layout_report(accel, batches: list[dict], layout: str, **shape) -> dict:
    report = {}
    for sp in (False, True):
        shared = run(accel, batches, layout="shared", sp=sp, **shape)
        other = run(accel, batches, layout=layout, sp=sp, **shape)
        report[f"sp={sp}"] = compare(shared, other)
        report[f"sp={sp}"]["encoded"] = {"shared": shared["images"], layout: other["images"]}
    frozen = run(accel, batches, layout=layout, sp=False, freeze=True, steps=2, **shape)
    report["backwards"] = {"trained": other["backwards"], "frozen": frozen["backwards"]}
    report["media"] = sum(int(mb["image_grid_thw"].shape[0] + mb["video_grid_thw"].shape[0]) for mb in batches)
    return report


def main() -> None:
    out = Path(sys.argv[1])
    accel = get_accelerator("cpu")
    with redirect_cuda(accel):
        init_distributed(accel)
        report = {}
        for layout, shape in LAYOUTS.items():
            if sys.argv[2:] and layout not in sys.argv[2:]:  # torchrun ... OUT.json [LAYOUT ...]: only those
                continue
            # megatron's default order: TP ranks are consecutive, then DP (or PP) replicas
            dp_rank = dist.get_rank() // 2 if "pp" not in shape else 0
            report[layout] = layout_report(accel, microbatches(out.parent, dp_rank), layout, **shape)
        everything = [None] * dist.get_world_size()
        dist.all_gather_object(everything, report)
        if dist.get_rank() == 0:
            out.write_text(json.dumps(everything))
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
