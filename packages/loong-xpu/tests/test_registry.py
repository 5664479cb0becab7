import subprocess
import sys
import textwrap

import pytest
import torch

from loong_xpu import Accelerator, backend_names, get_accelerator
from loong_xpu.backends.cpu import CpuAccelerator
from loong_xpu.registry import UnknownDeviceError


def test_builtin_backends_are_entry_points():
    assert {"cpu", "cuda"} <= set(backend_names())


def test_cpu_backend_facts():
    acc = get_accelerator("cpu")
    assert isinstance(acc, CpuAccelerator)
    assert acc.device() == torch.device("cpu")
    assert acc.dist_backend == "gloo" and acc.preferred_dtype == torch.float32
    assert acc.needs_cuda_redirect
    stats = acc.memory_stats()
    assert stats.peak_allocated >= stats.allocated > 0  # real RSS of this process
    state = acc.get_rng_state()
    a = torch.rand(3)
    acc.set_rng_state(state)
    assert torch.equal(torch.rand(3), a)


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto picks CUDA on a GPU machine")
def test_auto_takes_cpu_without_cuda(monkeypatch):
    monkeypatch.delenv("LOONG_DEVICE", raising=False)
    assert get_accelerator().name == "cpu"


def test_env_var_selects(monkeypatch):
    monkeypatch.setenv("LOONG_DEVICE", "cpu")
    assert get_accelerator().name == "cpu"


def test_unknown_device_lists_allowed():
    with pytest.raises(UnknownDeviceError, match=r"LOONG_DEVICE='npu' names no installed backend; allowed: auto, .*cpu.*cuda"):
        get_accelerator("npu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_unavailable_device_is_an_error():
    with pytest.raises(RuntimeError, match="no such device is available"):
        get_accelerator("cuda")


PLUGIN = '''
import torch
from loong_xpu.backends.cpu import CpuAccelerator

class ToyXPU(CpuAccelerator):
    """Stands in for an out-of-tree accelerator package (e.g. Kunlun XPU)."""
    name = "toyxpu"
    priority = 50
'''


def test_out_of_tree_backend_registers_through_entry_point(tmp_path):
    # A real installed distribution, found by importlib.metadata like any pip-installed plugin.
    (tmp_path / "toy_xpu.py").write_text(PLUGIN)
    dist_info = tmp_path / "toy_xpu-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-xpu\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text("[loong.accelerators]\ntoyxpu = toy_xpu:ToyXPU\n")
    script = textwrap.dedent("""
        import os, torch
        from loong_xpu import backend_names, get_accelerator
        assert "toyxpu" in backend_names(), backend_names()
        os.environ.pop("LOONG_DEVICE", None)
        picked = get_accelerator()
        expected = "cuda" if torch.cuda.is_available() else "toyxpu"  # priorities: cuda > plugin > cpu
        assert picked.name == expected, picked
        assert get_accelerator("toyxpu").dist_backend == "gloo"
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", script], env={"PYTHONPATH": str(tmp_path), "PATH": ""},
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_a_backend_must_subclass_accelerator():
    assert issubclass(CpuAccelerator, Accelerator)


def test_the_cpu_peak_memory_is_the_process_own_not_its_parents():
    """A process started by a parent holding 2 GiB reports its own peak (ru_maxrss would carry the
    parent's over exec)."""
    import subprocess
    import sys

    held = bytearray(2 << 30)  # zero-filled: every page touched, the parent's peak is >= 2 GiB
    code = "from loong_xpu.backends.cpu import CpuAccelerator; print(CpuAccelerator().memory_stats().peak_allocated)"
    child_peak = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    del held
    assert 0 < child_peak < 1.5 * 2**30, f"child peak {child_peak / 2**30:.2f} GiB"
