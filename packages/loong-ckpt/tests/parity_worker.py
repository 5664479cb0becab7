"""Loong logits of converted checkpoints (or HF dirs, loaded online) at a TP / PP layout.

    python -m torch.distributed.run --standalone --nproc-per-node 2 parity_worker.py --tp 2 --pp 1 [--ep 1] \
        <checkpoint or HF dir> <tokens.pt> <logits-out.pt> [<source> <tokens> <out> ...]

With ``--ep N`` (MoE models) the world has tp * pp * N ranks: data parallel N, experts split N ways;
every rank runs the same tokens, so the logits of any data-parallel rank are the model's.

Writes the full-vocabulary logits [batch, seq, vocab] (fp32) from the last pipeline stage. Several
jobs per launch: importing megatron-core costs ~10 s per process on a small host.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")


def loong_logits(source: str | Path, tokens: torch.Tensor, backend: str = "local") -> torch.Tensor | None:
    """Build the model for this rank (megatron groups must exist) with the ``backend`` layer spec on
    ``tokens``' device, load ``source``, run ``tokens``. Returns the logits on TP rank 0 of the last
    stage, None elsewhere."""
    from megatron.core import parallel_state as mpu

    from loong_ckpt.hf_config import foundation_from_dict
    from loong_ckpt.hf_io import is_hf_dir
    from loong_ckpt.online import load_hf_weights, read_hf_foundation
    from loong_ckpt.training import load_checkpoint, read_checkpoint_info
    from loong_models import build_foundation, build_transformer_config, fusion_fields

    tp, pp = mpu.get_tensor_model_parallel_world_size(), mpu.get_pipeline_model_parallel_world_size()
    ep = mpu.get_expert_model_parallel_world_size()
    online = is_hf_dir(source)
    if online:
        cfg = read_hf_foundation(source)
    else:
        cfg = foundation_from_dict(read_checkpoint_info(source).meta["foundation"])
    tconfig = build_transformer_config(
        cfg, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        **({"expert_model_parallel_size": ep} if cfg.moe is not None else {}),
        **(fusion_fields(backend) if backend == "te" else {}),  # TE's grouped-GEMM experts, fused ops
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
    )  # fmt: skip
    first, last = mpu.is_pipeline_first_stage(), mpu.is_pipeline_last_stage()
    model = build_foundation(cfg, tconfig, layer_backend=backend, pre_process=first, post_process=last)
    model.to(tokens.device)
    if online:
        load_hf_weights(source, [model], cfg)
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
        out = model(tokens, pos, None)
        if not last:
            dist.send(out.contiguous(), dst=mpu.get_pipeline_model_parallel_next_rank())
            return None
        if tp > 1:
            parts = [torch.empty_like(out) for _ in range(tp)]
            dist.all_gather(parts, out.contiguous(), group=mpu.get_tensor_model_parallel_group())
            out = torch.cat(parts, dim=-1)
    return out[..., : cfg.vocab_size].contiguous() if mpu.get_tensor_model_parallel_rank() == 0 else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--read-log", help="write the HF tensor names each rank reads to <dir>/rank<r>.txt")
    ap.add_argument("jobs", nargs="+", help="source tokens.pt out.pt, repeated")
    args = ap.parse_args()
    if len(args.jobs) % 3:
        ap.error("jobs come in triples: source tokens out")

    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    import loong_xpu

    read: list[str] = []
    if args.read_log:  # record what each rank reads from HF directories (EP ranks: their experts only)
        from loong_ckpt.hf_io import HFReader

        orig = HFReader.read

        def logged(self, name, *a, **k):
            read.append(name)
            return orig(self, name, *a, **k)

        HFReader.read = logged
    with loong_xpu.redirect_cuda(loong_xpu.get_accelerator("cpu")):
        dist.init_process_group("gloo")
        mpu.initialize_model_parallel(args.tp, args.pp, expert_model_parallel_size=args.ep)
        model_parallel_cuda_manual_seed(0)
        for i in range(0, len(args.jobs), 3):
            source, tokens, out = args.jobs[i : i + 3]
            logits = loong_logits(source, torch.load(tokens))
            if logits is not None and mpu.get_data_parallel_rank() == 0:
                torch.save(logits, out)
        if args.read_log:
            Path(args.read_log, f"rank{dist.get_rank()}.txt").write_text("\n".join(read))
        mpu.destroy_model_parallel()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
