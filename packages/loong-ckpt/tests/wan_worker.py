"""Loong Wan outputs at TP=N (torchrun, gloo): from a diffusers directory loaded online and from
a converted checkpoint, and with sequence parallelism (online; per-sample and per-token
timesteps), on the inputs of ``inputs.pt``; rank 0 saves them to ``out.pt``.

    python -m torch.distributed.run --standalone --nproc-per-node 2 wan_worker.py <diffusers dir> <ckpt> <inputs.pt> <out.pt>
"""

from __future__ import annotations

import sys
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")


def main(hf: str, ckpt: str, inputs: str, out: str) -> None:
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    import loong_xpu
    from loong_ckpt.diffusion import load_diffusers_weights, wan_config_from_meta
    from loong_ckpt.training import load_checkpoint, read_checkpoint_info
    from loong_models import ModelConfig, build_model, build_transformer_config

    with loong_xpu.redirect_cuda(loong_xpu.get_accelerator("cpu")):
        dist.init_process_group("gloo")
        mpu.initialize_model_parallel(dist.get_world_size(), 1)
        model_parallel_cuda_manual_seed(0)
        cfg = ModelConfig(diffusion=wan_config_from_meta(read_checkpoint_info(ckpt).meta, ckpt), layer_backend="local")
        x = torch.load(inputs)
        results = {}
        for kind in ("hf-online", "ckpt", "sp", "sp-tokens"):
            base = build_transformer_config(cfg.foundation, use_cpu_initialization=True, params_dtype=torch.float32,
                                            tensor_model_parallel_size=dist.get_world_size(),
                                            sequence_parallel=kind.startswith("sp"))  # fmt: skip
            model = build_model(cfg, base, device_type="cpu").eval()
            if kind == "ckpt":
                load_checkpoint(ckpt, [model])
            else:
                load_diffusers_weights(hf, [model], cfg.diffusion)
            t = x["timestep_tokens"] if kind == "sp-tokens" else x["timestep"]
            with torch.no_grad():
                results[kind] = model(x["latents"], t, x["context"])
        if dist.get_rank() == 0:
            torch.save(results, out)
        mpu.destroy_model_parallel()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:5])
