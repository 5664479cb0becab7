"""The CPU side of bench/long_context.py: its defaults are the issue's targets, the length search,
the CP commands, and one real probe of each kind on the tiny model (same loss, chunked or not)."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from loong_train.testing import load_script

_PATH = Path(__file__).parents[1] / "bench" / "long_context.py"
bench = load_script(_PATH)


def test_defaults_are_the_issue_shape():
    args = bench.parse_args(["chunkpipe"])
    assert (args.model, args.chunk, args.throughput_seq) == ("llama3.2-1b", 8192, 32768)
    assert args.chunk_attention == "fused"  # the layers' own attention (TE on the GPU)
    with pytest.raises(SystemExit):
        bench.parse_args(["cp", "--gpus", "4", "--seq", "1004"])


def test_the_search_doubles_then_bisects_to_the_longest_length_that_fits():
    tried = []

    def fits(n):
        tried.append(n)
        return n <= 100_000

    assert bench.longest_fitting(fits, 8192, 1 << 20, 8192) == 98304
    assert tried == [8192, 16384, 32768, 65536, 131072, 98304, 114688, 106496]
    assert bench.longest_fitting(lambda n: False, 8192, 1 << 20, 8192) == 0
    assert bench.longest_fitting(lambda n: True, 8192, 20000, 8192) == 16384  # capped by max_seq


def test_cp_runs_compare_cp_n_at_the_full_length_with_cp_1_at_a_share():
    args = bench.parse_args(["cp", "--gpus", "4", "--seq", "131072"])
    cmd = bench.cp_command(args, 4, 131072, Path("/tmp/x"))
    assert "--nproc-per-node=4" in cmd and "parallel.cp=4" in cmd and "data.seq_length=131072" in cmd
    assert "+model.foundation.recompute=full" in cmd and "parallel.cp_comm_type=p2p" in cmd


def test_a_chunkpipe_probe_and_a_plain_probe_give_the_same_loss():
    args = bench.parse_args(["chunkpipe", "--smoke", "--steps", "1", "--warmup", "0"])
    env = dict(os.environ, LOONG_DEVICE="cpu", OMP_NUM_THREADS="1")
    losses = {}
    for mode in ("base", "chunkpipe"):
        proc = subprocess.run(bench.probe_command(args, mode, 64), capture_output=True, text=True, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        assert result["seq"] == 64 and result["tokens_per_s"] > 0
        losses[mode] = result["loss"]
    assert losses["chunkpipe"] == pytest.approx(losses["base"], abs=1e-5)
