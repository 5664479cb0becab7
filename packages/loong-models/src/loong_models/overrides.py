"""Hydra command-line overrides checked against a config schema (nested dataclasses, as the zoo's
``ModelConfig``) before Hydra composes them, so that a misspelt key fails in one line with the
closest valid key, not with Hydra's multi-line report."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from importlib import resources

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException


def _dataclass_of(tp: object) -> type | None:
    """The dataclass a field holds (``X | None`` counts as X), else None: a leaf, list or dict."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        found = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        return found[0] if len(found) == 1 else None
    return tp if isinstance(tp, type) and dataclasses.is_dataclass(tp) else None


def config_groups(packages: tuple[str, ...]) -> set[str]:
    """The config groups (sub-directories) that the config packages ``packages`` ship."""
    return {p.name for pkg in packages for p in resources.files(pkg).iterdir() if p.is_dir()}


def unknown_key(key: str, schema: type, groups: set[str] = frozenset()) -> str | None:
    """A one-line message if ``key`` (dotted) names no field of ``schema`` (nor, alone, one of
    the config ``groups``), else None. Keys below a list, a dict or a plain value are left to the
    schema merge."""
    cls, path = schema, []
    for part in key.split("."):
        fields = [f.name for f in dataclasses.fields(cls)]
        if not path and "." not in key:
            fields += sorted(groups - set(fields))
        if part not in fields:
            close = difflib.get_close_matches(part, fields, n=1)
            where = ".".join(path) or "the top level"
            hint = f"did you mean {'.'.join([*path, close[0]])}? " if close else ""
            return f"{key}: no key {part!r} in {where}; {hint}allowed: {', '.join(fields)}"
        path.append(part)
        cls = _dataclass_of(typing.get_type_hints(cls).get(part))  # None for a group choice
        if cls is None:
            return None
    return None


def check_overrides(args: list[str], schema: type, group_packages: tuple[str, ...] = ()) -> str | None:
    """The first command-line override whose key the schema does not have (one line), else None.
    ``group_packages``: the Python packages holding the config groups (``model=...`` is a choice).
    ``+key=...`` (append), ``~key`` (delete), group choices (``model=...``), ``hydra.*`` and
    flags (``--cfg job``) are Hydra's to check."""
    try:
        overrides = OverridesParser.create().parse_overrides([a for a in args if "=" in a and not a.startswith("-")])
    except HydraException as e:
        return str(e).splitlines()[0]
    groups = config_groups(group_packages)
    for o in overrides:
        key = o.key_or_group
        if o.is_add() or o.is_force_add() or o.is_delete() or "/" in key or key.split(".")[0] in ("hydra",):
            continue
        if (message := unknown_key(key, schema, groups)) is not None:
            return message
    return None
