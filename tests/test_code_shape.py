"""The repository's shape rules that a reader relies on, checked on every run."""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 100  # a function fits on a screen (STYLE.md); the repo's median is far less
APP_MAX_LINES = 700  # the train app composes the packages; anything bigger belongs in one of them


def _sources(*roots: str) -> list[Path]:
    return sorted(p for r in roots for p in (ROOT / r).rglob("*.py") if ".venv" not in p.parts)


def function_lengths(paths: list[Path]) -> list[tuple[int, str]]:
    """(lines, "file:line name") of every function and method, longest first."""
    rows = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                rows.append((node.end_lineno - node.lineno + 1, f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"))
    return sorted(rows, reverse=True)


def test_no_function_is_longer_than_a_screen():
    too_long = [row for row in function_lengths(_sources("packages", "apps", "bench", "tests"))
                if row[0] > MAX_FUNCTION_LINES]  # fmt: skip
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines: {too_long}"


# Not counted: the test-support module, the Megatron-LM flag table (a declarative translation of
# another CLI into Loong's keys) and the `sample` entry point (a second app in the same package).
APP_NOT_COUNTED = ("testing.py", "megatron_args.py", "sample.py")


def test_the_train_app_stays_a_composition_root():
    lines = sum(len(p.read_text().splitlines()) for p in _sources("apps/train/src") if p.name not in APP_NOT_COUNTED)
    assert lines <= APP_MAX_LINES, f"apps/train/src has {lines} lines (at most {APP_MAX_LINES})"


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_the_train_app_does_not_import_megatron():
    offenders = [f"{p.relative_to(ROOT)}: {m}" for p in _sources("apps/train/src") for m in imported_modules(p)
                 if m.split(".")[0] == "megatron"]  # fmt: skip
    assert not offenders, f"megatron is loong-parallel's / loong-models' business, not the app's: {offenders}"


def test_package_sources_find_their_files_without_the_repository_layout():
    """An installed wheel has no repository around it: a package finds its bundled files through
    the one module that names them and another package's through that package (e.g.
    ``loong_data.bundled``), never by climbing up from ``__file__``."""
    offenders = [f"{p.relative_to(ROOT)}:{i}" for p in _sources("packages", "apps") if "src" in p.parts
                 for i, line in enumerate(p.read_text().splitlines(), 1) if "__file__).parents[" in line.replace(".resolve()", "")]  # fmt: skip
    assert not offenders, f"repository-relative lookups (use the owning package's path): {offenders}"


def _requirement_names(reqs: list[str]) -> set[str]:
    return {re.split(r"[<>=\[ ;]", r)[0].replace("_", "-").lower() for r in reqs}


# Import names whose distribution is named otherwise and may not be installed here (an optional extra).
_DIST_OF_IMPORT = {"sklearn": "scikit-learn", "skimage": "scikit-image", "PIL": "pillow", "yaml": "pyyaml"}


@functools.cache
def _installed() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def _distributions(module: str) -> set[str]:
    top = module.split(".")[0]
    found = _installed().get(top) or [_DIST_OF_IMPORT.get(top, top)]
    return {d.replace("_", "-").lower() for d in found}


def test_each_pyproject_declares_what_its_package_imports():
    """An installed wheel gets only its declared dependencies (an extra counts: e.g. a ``testing`` module's)."""
    missing = []
    for pyproject in sorted([*(ROOT / "packages").glob("*/pyproject.toml"), ROOT / "apps/train/pyproject.toml"]):
        project = tomllib.loads(pyproject.read_text())["project"]
        extras = [r for reqs in project.get("optional-dependencies", {}).values() for r in reqs]
        declared = _requirement_names(project["dependencies"] + extras)
        src = pyproject.parent / "src"
        own = {p.name for p in src.iterdir()}
        for path in sorted(src.rglob("*.py")):
            for module in imported_modules(path):
                top = module.split(".")[0]
                if top in own or top in sys.stdlib_module_names or top == "__future__":
                    continue
                if not _distributions(module) & declared:
                    missing.append(f"{path.relative_to(ROOT)}: {module}")
    assert not missing, f"imports their package's pyproject.toml does not declare: {missing}"


def _runtime_imports(path: Path, modules: set[str]) -> set[str]:
    """The package modules ``path`` imports, at the top or inside functions, but not for type checking."""
    tree = ast.parse(path.read_text(), str(path))
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)}  # fmt: skip
    names = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return {n for n in names if n in modules}


def test_no_two_modules_import_each_other():
    """Loops hidden by imports inside functions included (a package's ``__init__`` re-exports aside)."""
    files = {}
    for src in [*(ROOT / "packages").glob("*/src"), ROOT / "apps/train/src"]:
        for path in src.rglob("*.py"):
            parts = path.relative_to(src).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    imports = {m: {i for i in _runtime_imports(p, set(files)) if files[i].name != "__init__.py"} for m, p in files.items()}
    loops = sorted({tuple(sorted((a, b))) for a, deps in imports.items() for b in deps if a in imports.get(b, ())})
    assert not loops, f"modules that import each other: {loops}"
