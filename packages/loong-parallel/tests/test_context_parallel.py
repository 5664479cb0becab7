"""Context parallelism: the load-balanced split of micro-batches, the configs that cannot
combine with it, and (torchrun, gloo) 2- and 4-process CP layouts, alone and with TP and PP, for
plain and packed (THD) data, against the one-process loss and gradients in fp32: a GQA Llama and
deepseek-v3-tiny (multi-latent attention, MoE, and a multi-token-prediction layer whose label
shift crosses CP ranks) and a small deepseek-v32-tiny (DeepSeek sparse attention, all-gather CP). The same
launches run ChunkPipe across 2 and 4 pipeline stages (see cp_worker.py). The Wan DiT's
bidirectional CP (contiguous token parts, local cross-attention, the loss on each rank's part)
matches one process over optimizer steps (wan_cp_worker.py). The tiny VLM's packed micro-batches
with 0, 1 and 5 images and a video train under CP alone, with TP and sequence parallelism and
with DP like one process (vlm_cp_worker.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from loong_data import collate_packed
from loong_models.attention.cp_layout import zigzag_positions
from loong_parallel import ParallelConfig
from loong_parallel.context_parallel import (
    context_parallel_conflicts,
    cp_comm_type_conflicts,
    split_for_context_parallel,
)

WORKER = Path(__file__).with_name("cp_worker.py")
WAN_WORKER = Path(__file__).with_name("wan_cp_worker.py")
VLM_WORKER = Path(__file__).with_name("vlm_cp_worker.py")
TOL = 1e-5


def test_each_rank_holds_chunk_r_and_its_mirror_so_the_ranks_cover_the_sequence_once():
    assert zigzag_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    held = torch.cat([zigzag_positions(24, 3, r) for r in range(3)])
    assert sorted(held.tolist()) == list(range(24))
    with pytest.raises(ValueError, match="divisible by 2 x parallel.cp = 4"):
        zigzag_positions(10, 2, 0)


def test_packed_batches_split_every_document_and_keep_the_full_boundaries():
    samples = [{"tokens": torch.arange(n) + 100 * i, "labels": torch.arange(n), "loss_mask": torch.ones(n)}
               for i, n in enumerate([3, 6])]  # fmt: skip
    batch = collate_packed(samples, capacity=16, segment_multiple=4)
    assert batch["cu_seqlens"].tolist() == [0, 4, 12, 16]  # 3 -> 4, 6 -> 8, padding segment of 4
    assert batch["loss_mask"][0, 3] == 0 and batch["loss_mask"][0, 10:12].sum() == 0
    rank1 = split_for_context_parallel(batch, 2, 1)
    # document 0: chunks 1, 2 of [0 1 2 pad]; document 1: positions 2-5 of 100..105 pad pad
    assert rank1["tokens"][0, :6].tolist() == [1, 2, 102, 103, 104, 105]
    assert rank1["position_ids"][0, :2].tolist() == [1, 2]
    assert torch.equal(rank1["cu_seqlens"], batch["cu_seqlens"])
    with pytest.raises(ValueError, match="capacity 10 must be a multiple"):
        collate_packed(samples, capacity=10, segment_multiple=4)


def test_configs_that_cannot_combine_with_context_parallelism_are_named():
    cp2 = ParallelConfig(cp=2, tp=2, sequence_parallel=True)
    errors = context_parallel_conflicts(cp2, seq_length=36, features={"data.balance.enabled=true": True, "x": False})
    assert errors == [
        "parallel.cp=2 cannot combine with data.balance.enabled=true",
        "data.seq_length=36 must be a multiple of 2 x parallel.cp x parallel.tp (sequence parallel) = 8 "
        "(every sequence is cut into 2 x cp load-balanced chunks)",
    ]
    assert context_parallel_conflicts(ParallelConfig(), seq_length=5, features={"y": True}) == []
    with pytest.raises(ValueError, match="parallel.cp_comm_type='ring'; allowed: p2p, a2a, allgather"):
        ParallelConfig(cp=2, cp_comm_type="ring").validate(2, 2, 4, 2)
    with pytest.raises(ValueError, match=r"parallel.cp = 1 \* 1 \* 4"):
        ParallelConfig(cp=4).validate(6, 2, 4, 2)


def test_sparse_attention_takes_allgather_context_parallelism_only_and_dense_attention_refuses_it():
    class DSA:
        sparse_attention = object()

    def refused(comm: str, foundation) -> list[str]:
        return [k for k, on in cp_comm_type_conflicts(ParallelConfig(cp=2, cp_comm_type=comm), foundation).items() if on]

    assert refused("allgather", DSA()) == [] and refused("p2p", None) == [] and refused("a2a", None) == []
    for comm in ("p2p", "a2a"):
        assert refused(comm, DSA()) == [f"parallel.cp_comm_type={comm} (DeepSeek sparse attention, "
                                        "model.foundation.sparse_attention, runs context parallelism with "
                                        "parallel.cp_comm_type=allgather only)"]  # fmt: skip
    assert refused("allgather", None) == ["parallel.cp_comm_type=allgather (all-gather CP serves DeepSeek sparse "
                                          "attention, model.foundation.sparse_attention; dense attention takes p2p "
                                          "or a2a)"]  # fmt: skip


def _torchrun(nproc: int, layouts: list[str], out: Path, worker: Path = WORKER) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", LOONG_DEVICE="cpu")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--standalone",
           str(worker), str(out), *layouts]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.dist
@pytest.mark.parametrize(
    ("nproc", "layouts"),
    [
        (2, ["cp2", "cp2-a2a-thd", "chunkpipe-pp2", "chunkpipe-pp2-thd", "mla-cp2", "mla-mtp-cp2-thd", "mla-tp2-sp",
             "mla-dense-tp2", "dsa-cp2", "dsa-tp2-sp"]),
        (4, ["cp4", "cp2-tp2", "cp2-pp2", "cp2-a2a", "cp4-thd", "cp2-tp2-thd", "cp2-pp2-thd", "chunkpipe-pp4-thd",
             "mla-cp4-a2a", "mla-mtp-cp4-thd", "mla-mtp-cp2-pp2", "mla-mtp-cp2-tp2-sp", "dsa-cp4-thd", "dsa-cp2-tp2-sp"]),
    ],
    ids=["2-processes", "4-processes"],
)
def test_cp_and_chunkpipe_layouts_of_gqa_mla_and_dsa_models_match_one_process_in_loss_and_every_gradient(
    tmp_path, nproc, layouts
):
    """``mla-...``: deepseek-v3-tiny (MLA, MoE; ``mtp``: with an MTP layer; ``dense``: dense MLPs, for
    TP without sequence parallelism). Under TP, MLA's shared RoPE key and its query-latent norm need
    Loong's corrections of megatron's gradient reductions (loong_xpu.mla_rope_key, loong_models.norm's
    tp_replicated): without them TP differs from one process by ~1e-4. ``dsa-...``: deepseek-v32-tiny
    (absorbed MLA + DeepSeek sparse attention, 8 of 32 keys per query, the indexer trained by its
    loss) under all-gather CP, plain and THD, and TP + SP (megatron's AbsorbedMLA requires SP under TP; its shared
    RoPE key needs loong_xpu.mla_rope_key too: without it 4.6e-4)."""
    report = _torchrun(nproc, layouts, tmp_path / "report.json")
    assert sorted(report) == sorted(layouts)
    for layout, r in report.items():
        assert r["params"] > 20, layout
        assert r["loss_diff"] <= TOL, (layout, r)
        assert r["max_grad_diff"] <= TOL, (layout, r)


@pytest.mark.dist
def test_wan_cp_layouts_match_one_process_in_losses_and_every_gradient_over_steps(tmp_path):
    """wan-tiny (fp32, keep_attention recompute) under CP=2 / CP=4 ring, CP=2 all-to-all and
    CP=2 x TP=2 with sequence parallelism, in one 4-process launch: two optimizer steps of two
    micro-batches through the train app's forward step, megatron's schedule and DDP; and the
    velocity with per-token timesteps."""
    layouts = ["cp2", "cp4", "cp2-a2a", "cp2-tp2-sp"]
    report = _torchrun(4, layouts, tmp_path / "report.json", WAN_WORKER)
    assert sorted(report) == sorted(layouts)
    for layout, r in report.items():
        assert r["params"] > 50 and len(r["losses"]) == 2, layout
        assert r["ref_losses"][0] != r["ref_losses"][1], r  # the second step trained on new weights and data
        assert r["loss_diff"] <= TOL, (layout, r)
        assert r["max_grad_diff"] <= TOL * r["max_grad"], (layout, r)
        assert r["per_token_velocity_diff"] <= TOL, (layout, r)  # one timestep per token (Wan2.2 TI2V)


@pytest.mark.dist
@pytest.mark.parametrize(
    ("nproc", "layouts"),
    [(2, ["cp2", "cp2-qwen3vl"]), (4, ["cp4", "cp2-tp2-sp", "cp2-dp2"])],
    ids=["2-processes", "4-processes"],
)
def test_vlm_cp_layouts_match_one_process_in_losses_and_every_gradient_over_steps(tmp_path, nproc, layouts):
    """tiny-vlm (fp32) through the train app's forward step, megatron's schedule, DDP and Adam for
    three steps: every CP rank encodes the micro-batch's images, keeps the vision embeddings and
    multimodal positions of its zigzag tokens; the encoder's gradient is summed over CP by DDP.
    tiny-qwen3-vl adds DeepStack features (cut like the embeddings) and interleaved mrope."""
    report = _torchrun(nproc, layouts, tmp_path / "report.json", VLM_WORKER)
    assert sorted(report) == sorted(layouts)
    for layout, r in report.items():
        assert r["media"] == [0, 1, 5, 2] and r["params"] > 40, (layout, r)
        assert r["vision_grad"] > 0 and r["ref_losses"][0] != r["ref_losses"][-1], r  # the encoder trains
        assert r["loss_diff"] <= TOL, (layout, r)
        assert r["max_grad_diff"] <= TOL, (layout, r)
