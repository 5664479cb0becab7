"""Classes inside an optimizer's saved param groups, stored as names.

megatron's HybridDeviceOptimizer (optimizer state on the host, ``optim.offload_fraction``) keeps
its sub-optimizers' classes in every param group (``cpu_optimizer_cls``, ``gpu_optimizer_cls``),
so they reach the checkpoint's common state. The loader reads that state with torch's
weights-only unpickler, which refuses classes. Saving writes ``"class:<module>.<qualname>"``
instead; loading puts back only classes the running optimizer itself holds: a name from a file is
never imported."""

from __future__ import annotations

from typing import Any

from megatron.core.dist_checkpointing.dict_utils import dict_list_map_outplace

PREFIX = "class:"


def _name(cls: type) -> str:
    return f"{PREFIX}{cls.__module__}.{cls.__qualname__}"


def classes_to_names(tree: Any) -> Any:
    """A copy of the dicts and lists of ``tree`` with every class replaced by its name (other leaves shared)."""
    return dict_list_map_outplace(lambda v: _name(v) if isinstance(v, type) else v, tree)


def classes_in(param_groups: list[dict]) -> dict[str, type]:
    """The classes the running optimizer's param groups hold, by stored name."""
    return {_name(v): v for group in param_groups for v in group.values() if isinstance(v, type)}


def names_to_classes(tree: Any, known: dict[str, type]) -> Any:
    """``tree`` with the names of ``known`` classes back as the classes (unknown names stay strings)."""
    return dict_list_map_outplace(lambda v: known.get(v, v) if isinstance(v, str) and v.startswith(PREFIX) else v,
                                  tree)  # fmt: skip
