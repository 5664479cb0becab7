"""The CPU side of bench/kernels.py: the linear-CE target lines (TileLang vs torch.compile of the
unfused formula in time and peak memory; its variants against the default row). The cases need CUDA."""

from pathlib import Path

from loong_train.testing import load_script

_PATH = Path(__file__).parents[1] / "bench" / "kernels.py"
bench = load_script(_PATH, "bench_kernels")  # "kernels" is the HF hub-kernels package

CASE = "linear+cross-entropy fwd+bwd [N=8192 D=2048 V=128256]"


def _rows(tilelang_ms, tilelang_mib, compiled_ms=20.0, compiled_mib=5000.0):
    return [
        bench.Row(CASE, "reference", ms=40.0, peak_mib=12000.0),
        bench.Row(CASE, "tilelang", ms=tilelang_ms, peak_mib=tilelang_mib),
        bench.Row(CASE, "tl-overlap", ms=tilelang_ms / 2, peak_mib=tilelang_mib),
        bench.Row(CASE, "chunked", ms=25.0, peak_mib=1000.0),
        bench.Row(CASE, "compiled", ms=compiled_ms, peak_mib=compiled_mib),
    ]


def test_tilelang_must_beat_compiled_in_time_and_memory(capsys):
    assert bench.check_targets(_rows(tilelang_ms=16.0, tilelang_mib=1500.0))
    out = capsys.readouterr().out
    assert "beats torch.compile: 1.25x its speed, 30.0% of its peak; chunked reference 0.80x compiled -> MET" in out
    assert "tl-overlap: 2.00x the speed of the tilelang row" in out
    assert not bench.check_targets(_rows(tilelang_ms=21.0, tilelang_mib=1500.0))  # slower
    assert "-> MISSED" in capsys.readouterr().out
    assert not bench.check_targets(_rows(tilelang_ms=16.0, tilelang_mib=3100.0))  # > 25% of the unfused peak


def test_without_the_compiled_row_nothing_is_claimed(capsys):
    rows = [r for r in _rows(tilelang_ms=16.0, tilelang_mib=1500.0) if r.impl != "compiled"]
    assert bench.check_targets(rows)
    assert "torch.compile" not in capsys.readouterr().out
