"""The CPU side of bench/offload_copy_back.py (megatron's host-offloaded optimizer step with its own
and with loong_xpu's pinned copy-back): arguments, and the refusal without a GPU."""

import re
from pathlib import Path

import pytest
import torch

from loong_train.testing import load_script

bench = load_script(Path(__file__).parents[1] / "bench" / "offload_copy_back.py")


def test_defaults_are_one_ep4_rank_of_the_moe_bench_shape():
    args = bench.parse_args([])
    assert (args.params, args.offload_fraction, args.steps, args.warmup) == (0.78e9, 1.0, 6, 2)
    # megatron's step is the reference; the device updates are compared last
    assert args.variants == ["megatron", "pinned copy-back", "pinned + buckets", "device update",
                             "device update, bf16 moments"]


@pytest.mark.parametrize("argv, message", [
    (["--steps", "2", "--warmup", "2"], "--steps 2 must exceed --warmup 2"),
    (["--offload-fraction", "0"], r"--offload-fraction 0.0 must be in \(0, 1\]"),
    (["--params", "10", "--tensors", "64"], "--params 10 must be at least --tensors 64"),
    (["--variants", "device"], "invalid choice: 'device'"),
])  # fmt: skip
def test_bad_arguments_are_refused_naming_the_option(capsys, argv, message):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_without_a_gpu_it_says_what_it_needs():
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench.main(["--params", "1e3", "--tensors", "4"])
