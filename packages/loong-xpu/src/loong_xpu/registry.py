"""Finding backends (entry points) and choosing one (``LOONG_DEVICE``)."""

from __future__ import annotations

import os
from importlib.metadata import EntryPoint, entry_points

from loong_xpu.accelerator import Accelerator
from loong_xpu.log import logger

ENTRY_POINT_GROUP = "loong.accelerators"
ENV_VAR = "LOONG_DEVICE"


class UnknownDeviceError(ValueError):
    pass


def _entry_points() -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def backend_names() -> list[str]:
    """Names of every installed backend, built in or out of tree."""
    return sorted(_entry_points())


def load_backend(name: str) -> type[Accelerator]:
    eps = _entry_points()
    if name not in eps:
        raise UnknownDeviceError(
            f"{ENV_VAR}={name!r} names no installed backend; allowed: auto, {', '.join(sorted(eps))}. "
            f"Out-of-tree backends register an entry point in the {ENTRY_POINT_GROUP!r} group."
        )
    cls = eps[name].load()
    if not (isinstance(cls, type) and issubclass(cls, Accelerator)):
        raise TypeError(f"entry point {name!r} ({eps[name].value}) is not an Accelerator subclass")
    return cls


def get_accelerator(name: str | None = None) -> Accelerator:
    """The accelerator named by ``name``, else by ``$LOONG_DEVICE``, else ``auto``.

    ``auto`` takes the available backend of highest priority: CUDA (100) before out-of-tree
    plugins (which choose their own, typically 50) before the CPU (0).
    """
    name = (name or os.environ.get(ENV_VAR) or "auto").strip().lower()
    if name != "auto":
        cls = load_backend(name)
        if not cls.is_available():
            raise RuntimeError(f"{ENV_VAR}={name!r}: backend is installed but no such device is available")
        return cls()
    candidates = []
    for ep_name in backend_names():
        try:
            cls = load_backend(ep_name)
        except Exception as e:  # a broken plugin must not take the CPU path down with it
            logger.warning("skipping accelerator backend %r: %s", ep_name, e)
            continue
        if cls.is_available():
            candidates.append(cls)
    if not candidates:
        raise RuntimeError("no accelerator backend is available (the built-in 'cpu' one should be)")
    return max(candidates, key=lambda c: c.priority)()
