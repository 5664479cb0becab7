"""The measured per-shape choice: it picks the faster of two real implementations, caches per
shape, skips candidates that raise or disagree (with a log line), logs its table once, yields
to the override, and every rank takes rank 0's decision."""

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from loong_kernels import (
    dispatch,
    lightning_indexer_scores,
    lightning_indexer_topk,
    select_topk,
    sparse_mla_attention,
    use_implementation,
)
from loong_kernels.agreement import rel_diff
from loong_kernels.autotune import Autotuner
from loong_kernels.ops.dsa_tuning import sparse_mla_trial
from loong_kernels.reference import dsa as ref
from loong_xpu.testing import launch_env


def _inputs(n: int = 96, heads: int = 8, topk: int = 16) -> tuple:
    g = torch.Generator().manual_seed(0)
    q, kv = torch.randn(n, heads, 72, generator=g), torch.randn(n, 72, generator=g)
    scores = torch.randn(n, n, generator=g).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return q, kv, ref.topk_indices(scores, topk), 64, 72**-0.5


def _query_by_query_fwd(q, kv, indices, d_v, scale):
    """The reference forward called once per query: the same maths, many times slower."""
    outs = [ref.sparse_mla_fwd(q[t : t + 1], kv, indices[t : t + 1], d_v, scale) for t in range(q.shape[0])]
    return torch.cat([o for o, _ in outs]), torch.cat([lse for _, lse in outs])


def _query_by_query_bwd(q, kv, out, dout, indices, lse, d_v, scale):
    parts = [ref.sparse_mla_bwd(q[t : t + 1], kv, out[t : t + 1], dout[t : t + 1], indices[t : t + 1],
                                lse[t : t + 1], d_v, scale) for t in range(q.shape[0])]  # fmt: skip
    return torch.cat([dq for dq, _ in parts]), torch.stack([dkv for _, dkv in parts]).sum(0)


@pytest.fixture(autouse=True)
def one_thread():
    """Timings on a shared 2-core machine: one intra-op thread keeps oversubscription from swamping them."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


FAST = {"sparse_mla_fwd": ref.sparse_mla_fwd, "sparse_mla_bwd": ref.sparse_mla_bwd}
SLOW = {"sparse_mla_fwd": _query_by_query_fwd, "sparse_mla_bwd": _query_by_query_bwd}


@pytest.mark.parametrize("reference_is_fast", [True, False])
def test_the_faster_of_two_real_sparse_mla_implementations_wins_whichever_is_the_reference(reference_is_fast):
    args = _inputs()
    fast, slow = sparse_mla_trial(FAST, *args), sparse_mla_trial(SLOW, *args)
    candidates = {"reference": fast, "other": slow} if reference_is_fast else {"reference": slow, "other": fast}
    tuner = Autotuner(iters=5)
    winner = tuner.pick("k", candidates, reference="reference", check=rel_diff, tol=1e-5)
    decision = tuner.cache["k"]
    assert winner == ("reference" if reference_is_fast else "other")
    assert not decision.skipped  # the two agree, so both were timed


def _counted(step, calls: list[str], name: str):
    def run():
        calls.append(name)
        return step()

    return run


def test_a_decision_is_cached_per_shape_and_measured_anew_for_another_shape():
    calls: list[str] = []
    tuner = Autotuner(iters=2)
    for key, n in (("T<=128", 96), ("T<=128", 96), ("T<=64", 48)):
        args = _inputs(n)
        steps = {name: _counted(sparse_mla_trial(FAST, *args), calls, name) for name in ("reference", "copy")}
        tuner.pick(key, steps, reference="reference", check=rel_diff, tol=1e-5)
    # per measured key: the reference's truth + 2 timed runs, the other's check + 2 timed runs
    assert calls.count("reference") == 2 * 3 and calls.count("copy") == 2 * 3
    assert set(tuner.cache) == {"T<=128", "T<=64"}


def test_a_candidate_that_raises_or_disagrees_is_skipped_and_the_table_is_logged_once(caplog):
    args = _inputs(32)
    right = sparse_mla_trial(FAST, *args)

    def no_kernel():
        raise RuntimeError("no kernel for this shape")

    candidates = {"reference": right, "broken": no_kernel, "wrong": lambda: [x * 1.05 for x in right()]}
    tuner = Autotuner(iters=1)
    with caplog.at_level(logging.INFO, logger="loong_kernels"):
        for _ in range(2):
            assert tuner.pick("k", candidates, reference="reference", check=rel_diff, tol=2e-2) == "reference"
    skipped = tuner.cache["k"].skipped
    assert skipped["broken"] == "RuntimeError: no kernel for this shape"
    assert skipped["wrong"].startswith("ValueError: differs from reference: 0.05")
    text = caplog.text
    assert "autotune k: skipping broken (RuntimeError: no kernel for this shape)" in text
    assert "autotune k: skipping wrong (ValueError: differs from reference: 0.05" in text
    assert text.count("autotune k: reference (decided by this process)") == 1  # the table, once
    assert "<- chosen" in text and "broken" in text.split("decided by this process")[1]


def test_when_the_reference_itself_fails_the_fallback_is_chosen_and_kept_or_the_error_raised(caplog):
    def out_of_memory():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB")

    calls: list[str] = []
    candidates = {"reference": out_of_memory, "fast": _counted(lambda: [torch.ones(2)], calls, "fast")}
    tuner = Autotuner(iters=1)
    with caplog.at_level(logging.INFO, logger="loong_kernels"):
        for _ in range(2):
            assert tuner.pick("k", candidates, reference="reference", check=rel_diff, tol=0.0, fallback="fast") == "fast"
    assert not calls  # unchecked, so not timed either
    assert tuner.cache["k"].skipped == {"reference": "OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 GiB"}
    assert caplog.text.count("the reference failed (OutOfMemoryError") == 1
    with pytest.raises(torch.OutOfMemoryError):
        Autotuner().pick("k", candidates, reference="reference", check=rel_diff, tol=0.0)


def test_the_override_forces_an_implementation_without_measuring(monkeypatch):
    q, kv, idx, d_v, scale = _inputs(16)
    chooser = dispatch.Dispatcher()
    with use_implementation("reference"):
        assert chooser.choose_op("sparse_mla", q, kv, idx, d_v, scale) == "reference"
    with use_implementation("megatron"), pytest.raises(RuntimeError, match="sparse_mla: megatron-core was requested"):
        chooser.choose_op("sparse_mla", q, kv, idx, d_v, scale)
    monkeypatch.setenv(dispatch.ENV_VAR, "tilelang")
    with pytest.raises(RuntimeError, match="sparse_mla: TileLang was requested but cannot run: the inputs are on cpu"):
        chooser.choose_op("sparse_mla", q, kv, idx, d_v, scale)
    monkeypatch.setenv(dispatch.ENV_VAR, "megatron")  # kernels megatron-core lacks keep their own choice
    assert dispatch.choose("swiglu_fwd", torch.randn(2, 4)) == "reference"
    assert not chooser.autotuner.cache


def test_on_the_cpu_only_the_reference_runs_so_nothing_is_timed_and_the_op_still_works():
    q, kv, idx, d_v, scale = _inputs(16)
    chooser = dispatch.Dispatcher()
    with dispatch.use_dispatcher(chooser):
        q.requires_grad_()
        out, _ = sparse_mla_attention(q, kv, idx, d_v, scale)
        out.sum().backward()
        g = torch.Generator().manual_seed(1)
        q_i, k_i, w = torch.randn(40, 4, 16, generator=g), torch.randn(40, 16, generator=g), torch.randn(40, 4, generator=g)
        cu = torch.tensor([0, 15, 40])
        picked = lightning_indexer_topk(q_i, k_i, w, 8, cu)
    assert torch.equal(picked, select_topk(lightning_indexer_scores(q_i, k_i, w, cu), 8))
    assert q.grad is not None and not chooser.autotuner.cache
    assert dispatch.current_dispatcher() is not chooser  # the block's dispatcher is gone after it


def test_every_rank_runs_rank_0s_choice_even_where_its_own_timing_differs_and_pipeline_stages_decide_alone(tmp_path):
    worker = Path(__file__).with_name("autotune_ranks_worker.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(worker)]
    env = {**launch_env(), "AUTOTUNE_REPORT_DIR": str(tmp_path)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    reports = [line for rank in (0, 1) for line in (tmp_path / f"rank{rank}.txt").read_text().splitlines()]
    lines = dict(line.split(": ", 1) for line in reports)
    chosen = {key: line.split("chosen ")[1] for key, line in lines.items()}
    # rank 0's "a" is the fast one and rank 1's "b" (the timing tests above show the winner
    # follows the speed), yet both ranks run rank 0's choice; at PP=2 the two ranks are different
    # stages: each decides alone, with no collective that could deadlock against pipeline sends
    assert chosen["rank 0 world"] == chosen["rank 1 world"], lines
    assert chosen["rank 0 world"].endswith(" by rank 0 of 2"), lines
    assert chosen["rank 0 pp=2"].endswith(" by this process") and chosen["rank 1 pp=2"].endswith(" by this process")
