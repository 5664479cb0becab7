"""Loong logits of converted checkpoints (or HF dirs, loaded online) at a TP / PP layout.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m loong_ckpt.testing.parity_worker --tp 2 --pp 1 [--ep 1] \
        <checkpoint or HF dir> <tokens.pt> <logits-out.pt> [<source> <tokens> <out> ...]
    python -m torch.distributed.run --standalone --nproc-per-node 2 -m loong_ckpt.testing.parity_worker --jobs-file jobs.json

A jobs file lists ``{"source", "tokens", "out", "tp", "pp", "ep", "encoder_tp"}`` objects: one launch
runs several layouts of the same world size (the megatron groups are rebuilt between layouts).

With ``--ep N`` (MoE models) the world has tp * pp * N ranks: data parallel N, experts split N ways;
every rank runs the same tokens, so the logits of any data-parallel rank are the model's.

Writes the full-vocabulary logits [batch, seq, vocab] (fp32) from the last pipeline stage. Several
jobs per launch: importing megatron-core costs ~10 s per process on a small host. ``tokens.pt``
holds token ids [batch, seq], or for a VLM a dict of model inputs (``input_ids [1, S]``,
``pixel_values``, ``image_grid_thw``); ``--encoder-tp`` sets a VLM image encoder's own TP size.
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")


def loong_logits(
    source: str | Path, tokens: torch.Tensor | dict, backend: str = "local", encoder_tp: int | None = None
) -> torch.Tensor | None:
    """Build the model for this rank (megatron groups must exist) with the ``backend`` layer spec on
    ``tokens``' device, load ``source``, run ``tokens`` (token ids, or a VLM's input dict;
    ``encoder_tp``: the VLM image encoder's own TP size). Returns the logits on TP rank 0 of the
    last stage, None elsewhere."""
    import dataclasses

    from megatron.core import parallel_state as mpu

    from loong_ckpt.components import config_from_meta, foundation_of, is_composed
    from loong_ckpt.hf_io import is_hf_dir
    from loong_ckpt.online import load_hf_weights, read_hf_model
    from loong_ckpt.training import load_checkpoint, read_checkpoint_info
    from loong_models import build_foundation, build_model, build_transformer_config, fusion_fields

    tp, pp = mpu.get_tensor_model_parallel_world_size(), mpu.get_pipeline_model_parallel_world_size()
    ep = mpu.get_expert_model_parallel_world_size()
    online = is_hf_dir(source)
    model_cfg = read_hf_model(source) if online else config_from_meta(read_checkpoint_info(source).meta)
    cfg = foundation_of(model_cfg)
    media = {}
    if isinstance(tokens, dict):  # a VLM's inputs
        media = {k: v for k, v in tokens.items() if k != "input_ids"}
        tokens = tokens["input_ids"]
    tconfig = build_transformer_config(
        cfg, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        **({"expert_model_parallel_size": ep} if cfg.moe is not None else {}),
        **(fusion_fields(backend) if backend == "te" else {}),  # TE's grouped-GEMM experts, fused ops
        # megatron's absorbed MLA (DeepSeek sparse attention's) needs sequence parallelism at TP > 1
        **({"sequence_parallel": True} if tp > 1 and cfg.sparse_attention is not None else {}),
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
    )  # fmt: skip
    first, last = mpu.is_pipeline_first_stage(), mpu.is_pipeline_last_stage()
    if is_composed(model_cfg):
        model_cfg = dataclasses.replace(model_cfg, layer_backend=backend)
        groups = None
        if encoder_tp is not None and encoder_tp != tp:
            from loong_parallel.component_groups import component_process_groups

            enc = dataclasses.replace(model_cfg.image_encoder, tensor_model_parallel_size=encoder_tp)
            model_cfg = dataclasses.replace(model_cfg, image_encoder=enc)
            groups = component_process_groups(encoder_tp)
        model = build_model(model_cfg, tconfig, device_type=tokens.device.type, pre_process=first,
                            post_process=last, encoder_pg_collection=groups)  # fmt: skip
    else:
        model = build_foundation(cfg, tconfig, layer_backend=backend, pre_process=first, post_process=last)
    model.to(tokens.device)
    if online:
        load_hf_weights(source, [model], model_cfg)
    else:
        load_checkpoint(source, [model])
    model.eval()
    pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    b, s = tokens.shape
    with torch.no_grad():
        if not first:
            hidden = torch.empty(s, b, cfg.hidden_size)
            dist.recv(hidden, src=mpu.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        # a VLM computes its multimodal positions itself
        out = model(tokens, None, None, **media) if media else model(tokens, pos, None)
        if not last:
            dist.send(out.contiguous(), dst=mpu.get_pipeline_model_parallel_next_rank())
            return None
        if tp > 1:
            parts = [torch.empty_like(out) for _ in range(tp)]
            dist.all_gather(parts, out.contiguous(), group=mpu.get_tensor_model_parallel_group())
            out = torch.cat(parts, dim=-1)
    return out[..., : cfg.vocab_size].contiguous() if mpu.get_tensor_model_parallel_rank() == 0 else None


def _parse_jobs(argv: list[str] | None = None) -> tuple[list[dict], str | None]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--encoder-tp", type=int, default=None, help="a VLM image encoder's own TP size")
    ap.add_argument("--read-log", help="write the HF tensor names each rank reads to <dir>/rank<r>.txt")
    ap.add_argument("--jobs-file", help="a JSON list of jobs, each with its own layout (see the module doc)")
    ap.add_argument("jobs", nargs="*", help="source tokens.pt out.pt, repeated")
    args = ap.parse_args(argv)
    if args.jobs_file:
        return json.loads(Path(args.jobs_file).read_text()), args.read_log
    if not args.jobs or len(args.jobs) % 3:
        ap.error("jobs come in triples: source tokens out")
    layout = dict(tp=args.tp, pp=args.pp, ep=args.ep, encoder_tp=args.encoder_tp)
    return [dict(source=a, tokens=b, out=c, **layout) for a, b, c in zip(*[iter(args.jobs)] * 3)], args.read_log


def main() -> None:
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    import loong_xpu

    jobs, read_log = _parse_jobs()
    read: list[str] = []
    if read_log:  # record what each rank reads from HF directories (EP ranks: their experts only)
        from loong_ckpt.hf_io import HFReader

        orig = HFReader.read

        def logged(self, name, *a, **k):
            read.append(name)
            return orig(self, name, *a, **k)

        HFReader.read = logged
    with loong_xpu.redirect_cuda(loong_xpu.get_accelerator("cpu")):
        dist.init_process_group("gloo")
        layout = None
        for job in jobs:
            if layout != (job["tp"], job["pp"], job.get("ep", 1)):
                if layout is not None:
                    mpu.destroy_model_parallel()
                layout = (job["tp"], job["pp"], job.get("ep", 1))
                mpu.initialize_model_parallel(layout[0], layout[1], expert_model_parallel_size=layout[2])
                model_parallel_cuda_manual_seed(0)
            logits = loong_logits(job["source"], torch.load(job["tokens"]), encoder_tp=job.get("encoder_tp"))
            if logits is not None and mpu.get_data_parallel_rank() == 0:
                torch.save(logits, job["out"])
        if read_log:
            Path(read_log, f"rank{dist.get_rank()}.txt").write_text("\n".join(read))
        mpu.destroy_model_parallel()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
