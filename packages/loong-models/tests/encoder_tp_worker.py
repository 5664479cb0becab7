"""The tiny VLM's loss and image-encoder gradients at a foundation TP size and encoder TP sizes.

    python -m torch.distributed.run --standalone --nproc-per-node 1 encoder_tp_worker.py --runs 1,1,1 \
        --out <dir> --state <dir>/state.pt
    python -m torch.distributed.run --standalone --nproc-per-node 2 encoder_tp_worker.py \
        --runs 2,1,1 2,1,2 1,2,1 --out <dir> --state <dir>/state.pt

For each run (foundation TP, PP, encoder TP): build the model (TP layouts: same seed, megatron
initialises full weights on the host and shards them, so every TP layout starts from the same
weights; PP layouts load the one-process weights), wrap it in megatron's DDP,
run forward + backward on the same packed image/video batch, run megatron's finalize_model_grads
(the TP reduction of replicated-encoder gradients happens there), and write per rank
``<out>/tp<t>_pp<p>_etp<e>_rank<r>.pt`` = {"loss": [1, S] (the last stage's output, hidden
states on the first of two stages), "grads": {name: grad}} (first stage) for the encoder's
replicated (non-TP-sharded) parameters and, at encoder TP=1, all encoder and projector parameters.
Several layouts per launch: importing megatron-core costs ~10 s per process on a small host.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")


def forward_backward(model, ddp, batch: dict, hidden_size: int) -> torch.Tensor:
    """One micro-batch through this rank's pipeline stage, activations and their gradients sent
    point-to-point between the two stages (PP=2), or the whole model (PP=1). Returns the per-token
    loss on the last stage, the stage's output elsewhere."""
    from megatron.core import parallel_state as mpu

    first, last = mpu.is_pipeline_first_stage(), mpu.is_pipeline_last_stage()
    s = batch["input_ids"].shape[1]
    hidden = None
    if not first:
        hidden = torch.empty(s, 1, hidden_size)
        dist.recv(hidden, src=mpu.get_pipeline_model_parallel_prev_rank())
        hidden.requires_grad_(True)
        model.set_input_tensor(hidden)
    out = ddp(**batch)
    if last:
        out.sum().backward()
    else:
        dist.send(out.detach().contiguous(), dst=mpu.get_pipeline_model_parallel_next_rank())
        grad = torch.empty_like(out)
        dist.recv(grad, src=mpu.get_pipeline_model_parallel_next_rank())
        out.backward(grad)
    if hidden is not None:
        dist.send(hidden.grad.contiguous(), dst=mpu.get_pipeline_model_parallel_prev_rank())
    return out.detach()


def load_stage(model, state: dict[str, torch.Tensor]) -> None:
    """Load a one-process (TP=PP=1) state into this pipeline stage (TP=1): the stage's layers are
    numbered from 0 locally, megatron's ``layer_number`` is global; a tied output layer on the last
    stage takes the embedding's weight. Pipeline stages draw different random numbers at
    initialisation, so PP runs start from the one-process weights this way."""
    own = model.state_dict()
    for name in own:
        if name.endswith("_extra_state"):
            continue
        src = name
        if name.startswith("foundation.decoder.layers."):
            local = int(name.split(".")[3])
            layer = model.foundation.decoder.layers[local].layer_number - 1
            src = name.replace(f"layers.{local}.", f"layers.{layer}.", 1)
        if name == "foundation.output_layer.weight" and src not in state:
            src = "foundation.embedding.word_embeddings.weight"
        own[name] = state[src]
    model.load_state_dict(own)


def check_padding_zero(encoder, cfg, etp: int) -> None:
    """The MLP units past ffn_hidden_size are zero on every rank (this rank's share of them)."""
    if encoder is None:
        return
    per = cfg.padded_ffn_hidden_size // etp
    keep = min(per, max(0, cfg.ffn_hidden_size - dist.get_rank() % etp * per))
    for layer in encoder.decoder.layers:
        fc1, fc2 = layer.mlp.linear_fc1, layer.mlp.linear_fc2
        assert fc2.weight.shape[1] == per
        assert not fc1.weight.view(2, per, -1)[:, keep:].any() and not fc1.bias.view(2, per)[:, keep:].any()
        assert not fc2.weight[:, keep:].any() and fc2.weight[:, :keep].abs().sum() > 0


def run(tp: int, pp: int, etp: int, state_path: Path | None) -> dict:
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from loong_models import build_model, build_transformer_config, load_model_config
    from loong_models.testing import packed_batch
    from loong_parallel.component_groups import component_process_groups

    # the ViT MLP padded 128 -> 192 units: at encoder TP=2 rank 1 holds 32 real units and 64 of padding
    cfg = load_model_config("tiny-vlm", ["layer_backend=local", "foundation.num_layers=2",
                                         f"image_encoder.tensor_model_parallel_size={etp}",
                                         "+image_encoder.pad_ffn_to=96"])  # fmt: skip
    tconfig = build_transformer_config(cfg.foundation, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                       params_dtype=torch.float32, pipeline_dtype=torch.float32,
                                       use_cpu_initialization=True, calculate_per_token_loss=True)  # fmt: skip
    groups = component_process_groups(etp)
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    first, last = mpu.is_pipeline_first_stage(), mpu.is_pipeline_last_stage()
    model = build_model(cfg, tconfig, device_type="cpu", pre_process=first, post_process=last,
                        encoder_pg_collection=groups)  # fmt: skip
    if pp == 1 and tp == 1 and state_path is not None:
        torch.save(model.state_dict(), state_path)
    elif state_path is not None:
        load_stage(model, torch.load(state_path))
    check_padding_zero(model.image_encoder, cfg.image_encoder, etp)
    ddp = DistributedDataParallel(tconfig, DistributedDataParallelConfig(), model)
    out = forward_backward(model, ddp, packed_batch(), cfg.foundation.hidden_size)
    finalize_model_grads([ddp])
    if not first:  # the encoder lives on the first stage only
        assert model.image_encoder is None and model.image_projector is None
        return {"loss": out}
    replicated = [
        getattr(p, "average_gradients_across_tp_domain", False) for p in model.image_encoder.parameters()
    ]
    assert all(replicated) == (etp < tp) and any(replicated) == (etp < tp), "replicated-encoder tagging"
    grads = {}
    for prefix, module in (
        ("image_encoder.", model.image_encoder),
        ("image_projector.", model.image_projector),
    ):
        for name, p in module.named_parameters():
            if etp == 1 or not getattr(p, "tensor_model_parallel", False):
                grads[prefix + name] = p.main_grad.detach().clone()
    return {"loss": out, "grads": grads}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", nargs="+", required=True, help="TP,PP,ENCODER_TP per run, e.g. 2,1,1 1,2,1")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--state", type=Path, help="TP=PP=1: write the weights here; PP>1 (TP=1): load them")
    args = parser.parse_args()

    from megatron.core import parallel_state as mpu

    from loong_xpu import get_accelerator, redirect_cuda

    with redirect_cuda(get_accelerator("cpu")):
        dist.init_process_group("gloo")
        try:
            for spec in args.runs:
                tp, pp, etp = (int(x) for x in spec.split(","))
                if mpu.model_parallel_is_initialized():
                    mpu.destroy_model_parallel()
                mpu.initialize_model_parallel(tp, pp)
                state = args.state if tp == 1 else None  # TP layouts start from the same seed instead
                name = f"tp{tp}_pp{pp}_etp{etp}_rank{dist.get_rank()}.pt"
                torch.save(run(tp, pp, etp, state), args.out / name)
        finally:
            mpu.destroy_model_parallel()
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
