"""The README's CPU example runs as written."""

import pathlib
import re


def _run_readme_example(marker: str) -> dict:
    """Execute the README's first python block containing ``marker``; returns its globals."""
    readme = pathlib.Path(__file__).parents[1] / "README.md"
    blocks = re.findall(r"```python\n(.*?)```", readme.read_text(), re.S)
    scope: dict = {}
    exec(next(b for b in blocks if marker in b), scope)
    return scope


def test_readme_cpu_example_runs():
    scope = _run_readme_example("backward()")
    assert scope["res"].out.shape == (32, 4, 512)
    assert scope["q_i"].grad is not None and scope["kv"].grad is not None


def test_readme_autotune_example_picks_the_whole_matmul():
    scope = _run_readme_example("Autotuner")
    # one matmul against 4096 dot products: the gap is far beyond timing noise
    assert scope["winner"] == "reference"
    assert set(scope["tuner"].cache[("matmul", "64")].ms) == {"reference", "dot_by_dot"}
