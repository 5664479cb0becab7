"""Adaptive-FP8 policy files: for each GEMM kind and TP size, the token count from which FP8 is
faster than BF16 on one GPU with one TE version and recipe (measured by bench/fp8_policy.py).

Schema (JSON or YAML), LoongForge-compatible under ``rules`` (TE layer kind -> GEMM kind -> rules)::

    {"gpu_name": "NVIDIA H100 80GB HBM3", "te_version": "2.20.2", "recipe": "blockwise",
     "speedup_threshold": 1.02,
     "rules": {"layernorm_column": {"qkv": [{"tp": 1, "min_tokens": 8192, "measured_speedup": 1.18}]},
               "row": {"proj": [{"tp": 1, "min_tokens": null, "measured_speedup": 0.91}]}}}

``min_tokens: null`` means FP8 never won at the measured sizes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from loong_models.precision.config import FP8Recipe


@dataclass(frozen=True)
class Rule:
    tp: int
    min_tokens: int | None  # FP8 from this many tokens on; None: never
    measured_speedup: float  # BF16 time / FP8 time at the largest measured size


@dataclass(frozen=True)
class Fp8Policy:
    path: str
    gpu_name: str
    te_version: str
    recipe: str
    speedup_threshold: float
    rules: dict[str, dict[str, list[Rule]]]  # TE layer kind -> GEMM kind -> rules per TP size

    def rule(self, gemm: str, tp: int) -> Rule | None:
        for by_gemm in self.rules.values():
            for rule in by_gemm.get(gemm, []):
                if rule.tp == tp:
                    return rule
        return None

    def to_dict(self) -> dict:
        rules = {kind: {g: [r.__dict__ for r in rs] for g, rs in by_gemm.items()} for kind, by_gemm in self.rules.items()}
        return dict(gpu_name=self.gpu_name, te_version=self.te_version, recipe=self.recipe,
                    speedup_threshold=self.speedup_threshold, rules=rules)  # fmt: skip


def min_winning_tokens(points: Iterable[tuple[int, float]], threshold: float) -> int | None:
    """The smallest measured token count from which every larger measured count has a speedup
    (BF16 time / FP8 time) >= ``threshold``; None when the largest one loses. A win below a
    later loss does not count (the first crossing of a non-monotone sweep would)."""
    answer = None
    for tokens, speedup in sorted(points, reverse=True):
        if speedup < threshold:
            break
        answer = tokens
    return answer


def load_policy(path: str | Path) -> Fp8Policy:
    """Parse a policy file; errors name the file and the key."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"FP8 policy {path}: no such file (write one with bench/fp8_policy.py)")
    try:
        raw = json.loads(path.read_text()) if path.suffix == ".json" else OmegaConf.to_container(OmegaConf.load(path))
    except Exception as e:  # noqa: BLE001 - any parse error becomes one line naming the file
        raise ValueError(f"FP8 policy {path}: not valid {'JSON' if path.suffix == '.json' else 'YAML'} ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"FP8 policy {path}: expected a mapping at the top level")
    for key in ("gpu_name", "te_version", "recipe", "rules"):
        if key not in raw:
            raise ValueError(f"FP8 policy {path}: missing key {key!r}")
    if raw["recipe"] not in tuple(FP8Recipe):
        raise ValueError(f"FP8 policy {path}: recipe={raw['recipe']!r}; allowed: {', '.join(FP8Recipe)}")
    rules = {kind: {gemm: [_rule(path, kind, gemm, r) for r in rs] for gemm, rs in _mapping(path, kind, by_gemm).items()}
             for kind, by_gemm in _mapping(path, "rules", raw["rules"]).items()}  # fmt: skip
    return Fp8Policy(str(path), str(raw["gpu_name"]), str(raw["te_version"]), str(raw["recipe"]),
                     float(raw.get("speedup_threshold", 1.0)), rules)  # fmt: skip


def write_policy(policy: Fp8Policy, path: str | Path) -> None:
    Path(path).write_text(json.dumps(policy.to_dict(), indent=1) + "\n")


def _mapping(path: Path, key: str, value: object) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"FP8 policy {path}: {key} must be a mapping, got {type(value).__name__}")
    return value


def _rule(path: Path, kind: str, gemm: str, raw: object) -> Rule:
    where = f"FP8 policy {path}: rules.{kind}.{gemm}"
    if not isinstance(raw, dict) or "tp" not in raw or "min_tokens" not in raw:
        raise ValueError(f"{where}: each rule needs 'tp' and 'min_tokens' (got {raw!r})")
    tp, min_tokens = raw["tp"], raw["min_tokens"]
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"{where}: tp={tp!r} must be an integer >= 1")
    if min_tokens is not None and (not isinstance(min_tokens, int) or min_tokens < 1):
        raise ValueError(f"{where}: min_tokens={min_tokens!r} must be an integer >= 1 or null (never FP8)")
    return Rule(tp, min_tokens, float(raw.get("measured_speedup", float("nan"))))
