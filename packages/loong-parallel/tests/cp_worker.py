"""torchrun worker: context-parallel and ChunkPipe layouts against the one-process computation, in fp32.

Usage: ``torchrun --nproc-per-node N cp_worker.py OUT.json LAYOUT...`` with LAYOUT like
``cp2``, ``cp2-tp2``, ``cp2-pp2``, ``cp4-a2a``, ``cp2-thd``, ``chunkpipe-pp2-thd`` (ChunkPipe
runs every sample of the batch in chunks instead of megatron's schedule; ``sp``: sequence
parallelism, which megatron requires for MoE with TP). The model is a tiny GQA Llama;
``mla-...`` runs deepseek-v3-tiny instead (multi-latent attention: query/key and value head sizes
differ, a decoupled RoPE part shared by the heads; MoE layers after the first), ``mla-mtp-...``
with one multi-token-prediction layer, ``mla-dense-...`` with dense layers only (TP without SP);
``dsa-...`` a small deepseek-v32-tiny (DeepSeek sparse attention, all-gather CP).
The first pass runs with tp = pp = cp = 1 (every rank computes the whole global batch: the
one-process numbers); then each layout runs the same model, weights and global batch through
megatron's schedule, DDP and ``finalize_model_grads`` (which reduces gradients and token counts
over DP x CP). Every parameter's gradient is gathered back to full size (over TP and PP) and
compared with the reference; rank 0 writes the largest differences to OUT.json.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

from loong_data import collate_packed
from loong_models import ModelConfig, build_model, build_transformer_config, fusion_fields, load_model_config
from loong_models.chunked import enable_chunkpipe
from loong_models.foundation.build import moe_fields
from loong_models.packed_seq import packed_seq_params
from loong_parallel import (
    ParallelConfig,
    build_model_chunks,
    initialize_model_parallel,
    runtime_transformer_fields,
    unwrap,
)
from loong_parallel.chunkpipe import chunkpipe_forward_backward
from loong_parallel.context_parallel import split_for_context_parallel
from loong_parallel.testing import full_grads, tp_shard
from loong_xpu import get_accelerator, redirect_cuda

SEQ, MICRO, MICROBATCHES, LAYERS = 32, 2, 2, 4
DOCS = [[5, 11, 9], [21, 3], [2, 17, 6]]  # THD: documents per pack (padded to 2 x cp multiples)
CAPACITY = 64
CHUNK = 12  # ChunkPipe layouts: chunk boundaries fall inside documents, the last chunk is short


# model key (the words "mla" / "mtp" / "dense" of a layout name, see model_key) -> (zoo name, overrides)
MODELS = {
    "gqa": ("tiny", [f"foundation.num_layers={LAYERS}", "foundation.hidden_size=64", "foundation.ffn_hidden_size=128",
                     "foundation.kv_channels=16", "foundation.num_attention_heads=4",
                     "foundation.num_query_groups=2", "layer_backend=local"]),
    "mla": ("deepseek-v3-tiny", [f"foundation.num_layers={LAYERS}", "layer_backend=local"]),
    "mla-mtp": ("deepseek-v3-tiny", [f"foundation.num_layers={LAYERS}", "foundation.mtp_num_layers=1",
                                     "layer_backend=local"]),
    "mla-dense": ("deepseek-v3-tiny", [f"foundation.num_layers={LAYERS}", "layer_backend=local"]),
    # index_topk 8 of SEQ 32: the selection drops keys (with every key kept it would be dense MLA);
    # small and 2 layers to keep CI short (pp layouts would need LAYERS layers)
    "dsa": ("deepseek-v32-tiny", ["foundation.num_layers=2", "foundation.hidden_size=64", "foundation.ffn_hidden_size=128",
                                  "foundation.num_attention_heads=4", "foundation.vocab_size=1024",
                                  "foundation.sparse_attention.index_n_heads=4", "foundation.sparse_attention.index_topk=8",
                                  "layer_backend=local"]),
}  # fmt: skip


def without_moe(tconfig: TransformerConfig, cfg: ModelConfig) -> TransformerConfig:
    """``mla-dense``: deepseek-v3 requires MoE, and megatron's MoE refuses TP without SP; MLA under TP
    without SP (its RoPE key's gradient is reduced differently there) runs with dense MLPs instead."""
    moe = moe_fields(cfg.foundation)
    defaults = {f.name: f.default for f in dataclasses.fields(tconfig) if f.name in moe}
    return dataclasses.replace(tconfig, **defaults)


def model_key(layout: str) -> str:
    words = [w for w in layout.split("-") if w in ("mla", "mtp", "dense", "dsa")]
    return "-".join(words) or "gqa"


def parse(layout: str) -> tuple[ParallelConfig, bool, bool]:
    """(layout, packed data, ChunkPipe)."""
    words = layout.split("-")
    comm = "allgather" if "dsa" in words else "a2a" if "a2a" in words else "p2p"  # DSA: all-gather CP only
    kw: dict = {"cp_comm_type": comm, "sequence_parallel": "sp" in words}
    for part in layout.split("-"):
        for key in ("cp", "tp", "pp"):
            if part.startswith(key) and part[len(key):].isdigit():
                kw[key] = int(part[len(key):])
    return ParallelConfig(**kw), "thd" in layout, "chunkpipe" in layout


def global_batch(vocab: int, thd: bool) -> list[dict]:
    g = torch.Generator().manual_seed(7)
    if not thd:
        out = []
        for _ in range(MICROBATCHES):
            tokens = torch.randint(2, vocab, (MICRO, SEQ + 1), generator=g)
            mask = (torch.rand(MICRO, SEQ, generator=g) > 0.25).float()
            out.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": mask,
                        "position_ids": torch.arange(SEQ).expand(MICRO, SEQ)})  # fmt: skip
        return out
    packs = []
    for docs in DOCS:
        samples = []
        for n in docs:
            t = torch.randint(2, vocab, (n + 1,), generator=g)
            samples.append({"tokens": t[:-1], "labels": t[1:], "loss_mask": torch.ones(n)})
        packs.append(collate_packed(samples, capacity=CAPACITY, segment_multiple=8))
    return packs


def forward_step(pcfg: ParallelConfig, data_iterator, model):
    batch = split_for_context_parallel(next(data_iterator), pcfg.cp, mpu.get_context_parallel_rank())
    packed = packed_seq_params(batch["cu_seqlens"], batch["max_seqlen"]) if "cu_seqlens" in batch else None
    out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"], packed_seq_params=packed)
    return out, partial(_loss, batch["loss_mask"])


def _loss(mask, per_token):
    s = (per_token.reshape(-1) * mask.reshape(-1)).sum()
    n = mask.sum().to(torch.int)
    return s, n, {"lm loss": torch.stack([s.detach(), mask.sum()])}


def global_name(name: str, offset: int) -> str:
    """A parameter's name in the one-stage model (pipeline stages number their layers from 0)."""
    if not name.startswith("decoder.layers."):
        return name
    i, rest = name[len("decoder.layers."):].split(".", 1)
    return f"decoder.layers.{int(i) + offset}.{rest}"


@torch.no_grad()
def load_weights(chunks, weights: dict[str, torch.Tensor], layers_per_stage: int) -> None:
    """The one-stage model's weights into this layout (layers of later pipeline stages are
    initialised from other RNG draws, so every layout starts from the reference's weights)."""
    offset = mpu.get_pipeline_model_parallel_rank() * layers_per_stage
    model = unwrap(chunks[0])
    for name, p in model.named_parameters():
        key = global_name(name, offset)
        if key == "output_layer.weight" and key not in weights:
            key = "embedding.word_embeddings.weight"  # tied embeddings: the last stage's copy
        p.copy_(tp_shard(model, name, p, weights[key]))


def stage_grads(chunks, layers_per_stage: int) -> dict[str, torch.Tensor]:
    """name (global layer numbers) -> this stage's parameter's whole gradient, gathered over TP."""
    offset = mpu.get_pipeline_model_parallel_rank() * layers_per_stage
    return {global_name(name, offset): g for name, g in full_grads(unwrap(chunks[0])).items()}


def samples(microbatch: dict) -> list[dict]:
    """ChunkPipe takes one sample at a time: the rows of a [b, s] micro-batch (a THD pack is one)."""
    if "cu_seqlens" in microbatch:
        return [microbatch]
    return [{k: v[i : i + 1] for k, v in microbatch.items()} for i in range(microbatch["tokens"].shape[0])]


def run_chunkpipe(chunks, batch: list[dict]) -> list[dict]:
    """Every sample of the global batch through ChunkPipe (CHUNK tokens per chunk), then megatron's
    gradient finalisation with the batch's token count, as its schedule would do."""
    state = enable_chunkpipe(unwrap(chunks[0]))
    outputs, tokens = [], 0
    for sample in (s for mb in batch for s in samples(mb)):
        r = chunkpipe_forward_backward(chunks[0], state, sample, CHUNK, torch.device("cpu"))
        outputs.append({"lm loss": torch.tensor([r.loss_sum, r.num_tokens], dtype=torch.float64)})
        tokens += r.num_tokens
    finalize_model_grads(chunks, num_tokens=torch.tensor(tokens, dtype=torch.int))
    return outputs


def run_layout(pcfg: ParallelConfig, thd: bool, accel, chunked: bool = False, weights: dict | None = None,
               model: str = "gqa"):  # fmt: skip
    """(loss, gradients by global name, weights by global name) of one layout."""
    world = dist.get_world_size()
    initialize_model_parallel(pcfg, world)
    model_parallel_cuda_manual_seed(0)
    torch.manual_seed(0)
    cfg = load_model_config(*MODELS[model])
    tconfig = build_transformer_config(
        cfg.foundation, **runtime_transformer_fields(pcfg, dtype=torch.float32, device_type="cpu"), **fusion_fields("local")
    )
    if "dense" in model.split("-"):
        tconfig = without_moe(tconfig, cfg)

    def provider(pre, post, vp_stage):
        return build_model(cfg, tconfig, device_type="cpu", pre_process=pre, post_process=post, vp_stage=vp_stage)

    chunks = build_model_chunks(provider, pcfg, tconfig, accel)
    if weights is None:  # the reference: one stage, no TP
        weights = {n: p.detach().clone() for n, p in unwrap(chunks[0]).named_parameters()}
    else:
        load_weights(chunks, weights, LAYERS // pcfg.pp)
    batch = global_batch(cfg.foundation.vocab_size, thd)
    if chunked:
        outputs = run_chunkpipe(chunks, batch)
    else:
        outputs = get_forward_backward_func()(
            forward_step_func=partial(forward_step, pcfg), data_iterator=iter(batch), model=chunks,
            num_microbatches=len(batch), seq_length=batch[0]["tokens"].shape[1],
            micro_batch_size=batch[0]["tokens"].shape[0], forward_only=False,
        )  # fmt: skip
    total = torch.zeros(2, dtype=torch.float64)
    if mpu.is_pipeline_last_stage() and mpu.get_tensor_model_parallel_rank() == 0 and mpu.get_data_parallel_rank() == 0:
        for o in outputs:
            total += o["lm loss"].double()
    dist.all_reduce(total)
    grads = stage_grads(chunks, LAYERS // pcfg.pp)
    gathered = [None] * world
    dist.all_gather_object(gathered, grads)
    merged: dict[str, torch.Tensor] = {}
    for part in gathered:
        for k, v in part.items():
            merged.setdefault(k, v)
    mpu.destroy_model_parallel()
    forget_router_metrics()
    return float(total[0] / total[1]), merged, weights


def forget_router_metrics() -> None:
    """megatron's MoE and MTP trackers are process-wide and size their per-layer entries on first
    use; the next layout may have another layer count (an MTP layer)."""
    get_moe_metrics_tracker()._metrics.clear()
    MTPLossLoggingHelper.tracker.clear()


def main() -> None:
    out_path, layouts = sys.argv[1], sys.argv[2:]
    accel = get_accelerator("cpu")
    with redirect_cuda(accel):
        dist.init_process_group("gloo")
        cases = sorted({(model_key(x), parse(x)[1]) for x in layouts})
        refs = {(m, thd): run_layout(ParallelConfig(), thd, accel, model=m) for m, thd in cases}
        report = {}
        for layout in layouts:
            pcfg, thd, chunked = parse(layout)
            model = model_key(layout)
            ref_loss, ref_grads, weights = refs[model, thd]
            loss, grads, _ = run_layout(pcfg, thd, accel, chunked, weights, model)
            if "output_layer.weight" in grads and "output_layer.weight" not in ref_grads:
                # tied embeddings under PP: the last stage's output layer is a copy of the input
                # embedding, and megatron makes their gradients the embedding's whole gradient
                ref_grads = {**ref_grads, "output_layer.weight": ref_grads["embedding.word_embeddings.weight"]}
            assert grads.keys() == ref_grads.keys(), sorted(set(grads) ^ set(ref_grads))
            diffs = {k: (grads[k] - ref_grads[k]).abs().max().item() for k in grads}
            worst = max(diffs, key=diffs.__getitem__)
            diff = diffs[worst]
            scale = max(v.abs().max().item() for v in ref_grads.values())
            report[layout] = {"loss": loss, "ref_loss": ref_loss, "loss_diff": abs(loss - ref_loss),
                              "max_grad_diff": diff, "worst": worst, "max_grad": scale, "params": len(grads)}  # fmt: skip
        if dist.get_rank() == 0:
            with open(out_path, "w") as f:
                json.dump(report, f, indent=1)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
