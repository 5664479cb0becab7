"""The one dispatch point: what it picks, its overrides, and that its table is well formed."""

import importlib
import subprocess
import sys

import pytest
import torch
from loong_kernels import choose, dispatch, use_implementation
from loong_kernels.tilelang_support import tilelang_importable


def test_cpu_tensors_use_the_reference():
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    assert choose("rms_norm_fwd", x, torch.ones(8), None, 1e-6) == "reference"


def test_forcing_tilelang_where_it_cannot_run_is_an_error():
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    with use_implementation("tilelang"), pytest.raises(RuntimeError, match="swiglu_fwd: TileLang was requested"):
        choose("swiglu_fwd", x)
    with use_implementation("reference"):
        assert choose("swiglu_fwd", x) == "reference"


def test_bad_override_names_the_allowed_values(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    with pytest.raises(ValueError, match="allowed: auto, tilelang, reference"):
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
