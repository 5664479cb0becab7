"""The one dispatch point: what it picks, its overrides, and that its table is well formed."""

import importlib
import logging
import subprocess
import sys

import pytest
import torch

from loong_kernels import choose, dispatch, use_implementation
from loong_kernels.tilelang_support import tilelang_importable


def test_cpu_tensors_use_the_reference():
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    assert choose("rms_norm_fwd", x, torch.ones(8), None, 1e-6) == "reference"


def test_a_cpu_fallback_is_quiet_but_a_cuda_run_without_tilelang_warns_once_per_kernel(caplog):
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    with caplog.at_level(logging.DEBUG, logger="loong_kernels"):
        choose("swiglu_fwd", x)  # CPU inputs: the reference is the expected choice
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        # the reason _tilelang_blocker gives for CUDA inputs when tilelang does not import
        for _ in range(2):
            dispatch._log_fallback("test_kernel_without_tilelang", f"TileLang: {dispatch.NO_TILELANG}")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "test_kernel_without_tilelang" in warnings[0] and "pip install loong-kernels[tilelang]" in warnings[0]


def test_forcing_tilelang_where_it_cannot_run_is_an_error():
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    with use_implementation("tilelang"), pytest.raises(RuntimeError, match="swiglu_fwd: TileLang was requested"):
        choose("swiglu_fwd", x)
    with use_implementation("reference"):
        assert choose("swiglu_fwd", x) == "reference"


def test_bad_override_names_the_allowed_values(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    with pytest.raises(ValueError, match="allowed: auto, tilelang, megatron, reference"):
        choose("swiglu_fwd", torch.randn(2, 4))
    with pytest.raises(ValueError), use_implementation("fast"):  # type: ignore[arg-type]
        pass


def test_every_reference_in_the_table_imports():
    for name, entry in dispatch.KERNELS.items():
        assert callable(dispatch._load(entry.reference)), name


@pytest.mark.skipif(not tilelang_importable(), reason="tilelang is not importable")
def test_every_tilelang_entry_imports():
    for name, entry in dispatch.KERNELS.items():
        for path in (entry.tilelang, entry.supports):
            if path is not None:
                module, _, attr = path.partition(":")
                assert callable(getattr(importlib.import_module(module), attr)), (name, path)


def test_package_imports_and_runs_without_tilelang():
    # a None entry in sys.modules makes `import tilelang` fail, as on a machine without it
    code = (
        "import sys; sys.modules['tilelang'] = None\n"
        "import torch, loong_kernels as lk\n"
        "from loong_kernels.tilelang_support import tilelang_importable\n"
        "assert not tilelang_importable()\n"
        "y, _ = lk.rms_norm(torch.randn(2, 8), torch.ones(8))\n"
        "assert lk.choose('swiglu_fwd', torch.randn(2, 4)) == 'reference'\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


@pytest.mark.skipif(not tilelang_importable(), reason="tilelang is not importable")
def test_tilelang_shape_predicates_accept_deepseek_v32_shapes():
    from loong_kernels.tl import indexer, rms_norm, sparse_mla, swiglu

    bf = torch.bfloat16
    n, k = 8, 2048
    q, kv = torch.empty(n, 128, 576, dtype=bf), torch.empty(n, 576, dtype=bf)
    idx, lse = torch.empty(n, k, dtype=torch.int32), torch.empty(n, 128)
    q_i, k_i, w = torch.empty(n, 64, 128, dtype=bf), torch.empty(n, 128, dtype=bf), torch.empty(n, 64, dtype=bf)
    assert sparse_mla.supports(q, kv, idx, 512, 0.1)
    assert sparse_mla.supports_bwd(q, kv, None, None, idx, lse, 512, 0.1)
    assert sparse_mla.supports_probs(q, kv, idx, lse, 0.1)
    assert indexer.supports_scores(q_i, k_i, w, idx)
    assert indexer.supports_topk(q_i, k_i, w, idx)
    assert rms_norm.supports(torch.empty(n, 7168, dtype=bf), torch.empty(7168, dtype=bf), None, 1e-6)
    assert swiglu.supports(torch.empty(n, 2 * 2048, dtype=bf))
    # and refuse what the kernels cannot do
    assert not sparse_mla.supports(torch.empty(n, 20, 576, dtype=bf), kv, idx, 512, 0.1)
    assert not sparse_mla.supports(q, kv, idx, 576, 0.1)  # no RoPE tail


def test_sparse_mla_refuses_shapes_whose_gemms_cannot_be_split_over_the_warps():
    """16 heads with a 16-wide RoPE tail: TileLang cannot give each of 4 warps a 16x8 tile of the
    16x16 tail GEMM, so the reference must run (a GPU run hit the compile error before this check)."""
    from loong_kernels.tl import sparse_mla

    q = torch.empty(8, 16, 64 + 16, dtype=torch.bfloat16)
    kv = torch.empty(8, 64 + 16, dtype=torch.bfloat16)
    assert not sparse_mla.supports(q, kv, None, 64, 1.0)
    q32 = torch.empty(8, 16, 64 + 32, dtype=torch.bfloat16)
    kv32 = torch.empty(8, 64 + 32, dtype=torch.bfloat16)
    assert sparse_mla.supports(q32, kv32, None, 64, 1.0)


def test_every_megatron_entry_and_tuned_op_resolves():
    for name, entry in dispatch.KERNELS.items():
        for path in (entry.megatron, entry.megatron_blocker):
            if path is not None:
                assert callable(dispatch._load(path)), (name, path)
    for op, tuned in dispatch.TUNED.items():
        assert all(k in dispatch.KERNELS for k in tuned.kernels), op
        for path in (tuned.trial, tuned.key, tuned.check):
            assert callable(dispatch._load(path)), (op, path)



def test_runs_tilelang_reads_the_override_as_choose_does(monkeypatch):
    from loong_kernels.dispatch import runs_tilelang

    x, tables = torch.zeros(4, 6 * 16), torch.zeros(0, 16)
    args = (x, tables, tables, tables, tables, 4, 1)
    monkeypatch.setattr(dispatch, "_tilelang_blocker", lambda entry, a: None)  # as where the kernel can run
    for override, runs in (("auto", True), ("tilelang", True), ("reference", False),
                           ("megatron", True)):  # (qkv_rope has no megatron-core kernel: the automatic choice)  # fmt: skip
        monkeypatch.setenv("LOONG_KERNELS_IMPL", override)
        assert runs_tilelang("qkv_rope_fwd", *args) is runs, override
        assert (choose("qkv_rope_fwd", *args) == "tilelang") is runs, override
