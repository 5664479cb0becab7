"""TP=2 and PP=2 (torchrun, 2 processes, gloo): the converted checkpoint and the HF directory
loaded online both give HF's logits, for every dense family; EP=2 for the MoE families."""

from __future__ import annotations

import re

import pytest

from loong_ckpt.testing import FAMILIES, MOE_FAMILIES, get_converted, run_workers

TOL = 1e-4


@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    """converted(family) -> Converted (shared by every module of the session)."""
    return lambda family: get_converted(tmp_path_factory, family)


@pytest.mark.dist
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_logits_match_hf(tp, pp, converted, tmp_path):
    cases = [(family, kind) for family in FAMILIES for kind in ("ckpt", "hf-online")]
    jobs = []
    for family, kind in cases:
        c = converted(family)
        jobs.append((c.ckpt if kind == "ckpt" else c.hf, c.tokens, tmp_path / f"{family}-{kind}.pt"))
    results = run_workers(jobs, tp=tp, pp=pp)
    for (family, kind), logits in zip(cases, results):
        ref = converted(family).ref
        assert logits.shape == ref.shape
        diff = (logits - ref).abs().max().item()
        assert diff <= TOL, f"{family} {kind} at tp={tp} pp={pp}: max abs diff {diff}"


@pytest.mark.dist
def test_moe_logits_match_hf_ep2(converted, tmp_path):
    """EP=2 (experts split over 2 ranks): the converted checkpoint and the HF directory loaded
    online give HF's logits, and online each rank reads only its own experts' HF tensors."""
    cases = [(family, kind) for family in MOE_FAMILIES for kind in ("ckpt", "hf-online")]
    jobs = []
    for family, kind in cases:
        c = converted(family)
        jobs.append((c.ckpt if kind == "ckpt" else c.hf, c.tokens, tmp_path / f"{family}-{kind}.pt"))
    (tmp_path / "reads").mkdir()
    results = run_workers(jobs, tp=1, pp=1, ep=2, read_log=tmp_path / "reads")
    for (family, kind), logits in zip(cases, results):
        ref = converted(family).ref
        assert logits.shape == ref.shape
        diff = (logits - ref).abs().max().item()
        assert diff <= TOL, f"{family} {kind} at ep=2: max abs diff {diff}"
    for rank in range(2):  # 4 experts: rank 0 holds 0-1, rank 1 holds 2-3
        read = (tmp_path / "reads" / f"rank{rank}.txt").read_text().split()
        experts = {int(m.group(1)) for n in read if (m := re.search(r"mlp\.experts\.(\d+)\.", n))}
        assert experts == {2 * rank, 2 * rank + 1}, (rank, sorted(experts))
        assert any("self_attn" in n for n in read)  # and everything else it holds
