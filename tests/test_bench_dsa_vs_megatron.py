"""The CPU side of bench/dsa_vs_megatron.py: shapes, the two checks (relative difference of the
attention tensors, keys the reference did not select), and that a wrong implementation is caught
on real DSA inputs at a tiny shape (the TileLang kernels of Loong and megatron-core need CUDA)."""

from pathlib import Path

import pytest
import torch

from loong_train.testing import load_script

_PATH = Path(__file__).parents[1] / "bench" / "dsa_vs_megatron.py"
bench = load_script(_PATH)


def test_shapes_are_tokens_heads_topk_and_bad_ones_are_named():
    assert bench.parse_shape("8192x128x2048") == (8192, 128, 2048)
    with pytest.raises(SystemExit, match="--shapes '8192x128': expected TxHxK"):
        bench.parse_shape("8192x128")
    with pytest.raises(SystemExit, match="sizes must be >= 1"):
        bench.parse_shape("8192x0x2048")


def test_the_checks_measure_relative_difference_and_keys_the_reference_did_not_pick():
    ref = [torch.tensor([[1.0, -4.0]]), torch.tensor([10.0])]
    assert bench.rel_diff([torch.tensor([[1.0, -3.9]]), torch.tensor([10.0])], ref) == pytest.approx(0.025)
    want = torch.tensor([[0, 1, 2, -1], [3, 2, 1, 0]])
    assert (
        bench.missed_fraction([torch.tensor([[2, 1, 0, -1], [0, 1, 2, 3]])], [want]) == 0.0
    )  # order, empties
    assert bench.missed_fraction([torch.tensor([[2, 1, 3, -1], [0, 1, 2, 3]])], [want]) == pytest.approx(
        1 / 7
    )


@pytest.fixture(scope="module")
def tiny_inputs():
    from kernels import _dsa_inputs

    return _dsa_inputs(64, 16, bench.IDX_HEADS, 16, device="cpu")


def test_both_cases_agree_with_their_reference_and_a_wrong_kernel_is_an_error(tiny_inputs):
    attention = bench.attention_case(tiny_inputs, "[tiny]")
    del attention.steps["loong"]  # TileLang: CUDA only
    right = attention.steps["reference"]
    attention.steps["megatron"] = lambda: [x * 1.05 for x in right()]  # 5% off: caught
    rows = {r.impl: r for r in bench.run(attention, 0, bench.rel_diff, 2e-2)}
    assert rows["reference-tf32"].error is None and rows["reference-tf32"].max_diff < 1e-6
    assert rows["megatron"].error.startswith("differs from the float32 reference: 0.05")

    indexer = bench.indexer_case(tiny_inputs, 16, "[tiny]")
    del indexer.steps["loong"]
    rows = {r.impl: r for r in bench.run(indexer, 0, bench.missed_fraction, 0.01)}
    assert rows["reference-tf32"].max_diff == 0.0 and rows["reference-tf32"].error is None


def test_the_speed_ratio_is_megatrons_time_over_loongs():
    rows = [
        bench.Row("c", "loong", ms=2.0),
        bench.Row("c", "megatron", ms=3.0),
        bench.Row("d", "loong", ms=1.0),
    ]
    assert bench.speedups(rows) == ["c: Loong 1.50x megatron-core"]
