"""The README's CPU example runs as written."""

import pathlib
import re


def test_readme_cpu_example_runs():
    readme = pathlib.Path(__file__).parents[1] / "README.md"
    blocks = re.findall(r"```python\n(.*?)```", readme.read_text(), re.S)
    example = next(b for b in blocks if "backward()" in b)
    scope: dict = {}
    exec(example, scope)
    assert scope["res"].out.shape == (32, 4, 512)
    assert scope["q_i"].grad is not None and scope["kv"].grad is not None
