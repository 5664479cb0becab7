"""TP=2 and PP=2 (torchrun, 2 processes, gloo): the converted checkpoint and the HF directory
loaded online both give HF's logits, for every family."""

from __future__ import annotations

import pytest
from ckpt_testlib import FAMILIES, get_converted, run_workers

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
