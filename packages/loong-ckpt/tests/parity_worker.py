"""Loong logits of a converted checkpoint (or an HF dir, loaded online) at a TP / PP layout.

    python -m torch.distributed.run --standalone --nproc-per-node 2 parity_worker.py \
        <checkpoint or HF dir> <tokens.pt> <logits-out.pt> --tp 2 --pp 1

Writes the full-vocabulary logits [batch, seq, vocab] (fp32) from the last pipeline stage.
"""

from __future__ import annotations

import argparse
import os
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("source")
    ap.add_argument("tokens")
    ap.add_argument("out")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    args = ap.parse_args()

    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    import loong_xpu
    from loong_ckpt.hf_config import foundation_from_dict
    from loong_ckpt.hf_io import is_hf_dir
    from loong_ckpt.online import load_hf_weights, read_hf_foundation
    from loong_ckpt.training import load_checkpoint, read_checkpoint_info
    from loong_models import build_foundation, build_transformer_config

    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29600 + os.getpid() % 300))
    with loong_xpu.redirect_cuda(loong_xpu.get_accelerator("cpu")):
        dist.init_process_group("gloo")
        mpu.initialize_model_parallel(args.tp, args.pp)
        model_parallel_cuda_manual_seed(0)
        online = is_hf_dir(args.source)
        cfg = read_hf_foundation(args.source) if online else foundation_from_dict(
            read_checkpoint_info(args.source).meta["foundation"])
        tconfig = build_transformer_config(
            cfg, tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
            use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        )  # fmt: skip
        first, last = mpu.is_pipeline_first_stage(), mpu.is_pipeline_last_stage()
        model = build_foundation(cfg, tconfig, layer_backend="local", pre_process=first, post_process=last)
        if online:
            load_hf_weights(args.source, [model], cfg)
        else:
            load_checkpoint(args.source, [model])
        model.eval()
        tokens = torch.load(args.tokens)
        pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
        b, s, h = tokens.shape[0], tokens.shape[1], cfg.hidden_size
        with torch.no_grad():
            if not first:
                hidden = torch.empty(s, b, h)
                dist.recv(hidden, src=mpu.get_pipeline_model_parallel_prev_rank())
                model.set_input_tensor(hidden)
            out = model(tokens, pos, None)
            if not last:
                dist.send(out.contiguous(), dst=mpu.get_pipeline_model_parallel_next_rank())
            else:
                if args.tp > 1:
                    parts = [torch.empty_like(out) for _ in range(args.tp)]
                    dist.all_gather(parts, out.contiguous(), group=mpu.get_tensor_model_parallel_group())
                    out = torch.cat(parts, dim=-1)
                if mpu.get_tensor_model_parallel_rank() == 0:
                    torch.save(out[..., : cfg.vocab_size].contiguous(), args.out)
        mpu.destroy_model_parallel()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
