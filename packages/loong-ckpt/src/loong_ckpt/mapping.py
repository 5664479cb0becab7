"""The one mapping mechanism between HF parameter names and megatron checkpoint keys.

A family's mapping is a list of :class:`Rule` s. Each rule names one megatron checkpoint key (the
key of the unwrapped GPTModel's ``sharded_state_dict()`` without a layer index), the HF tensor(s)
it is made of (``{i}`` = layer index, ``{e}`` = expert index), a :class:`Transform` between the
two (identity, QKV fused per KV group, gate/up fused) and how tensor parallelism splits it
(:class:`Split`).

Megatron names per-layer tensors in one of two ways, and both map through the same rule:
homogeneous decoders stack layers on the tensor's first axis (``decoder.layers.mlp.linear_fc2.weight``,
shape ``[layers, ...]``); decoders whose layers differ (MoE models with dense first layers, or any
``moe_layer_freq`` list) index the key (``decoder.layers.3.mlp.linear_fc2.weight``). Routed experts
add an expert axis (``decoder.layers.3.mlp.experts.experts.linear_fc1.weight``, ``[experts, ...]``,
global expert ids whatever the expert-parallel layout). :func:`units` lists the (rule, layer,
expert) tensors a config has; :func:`locate` finds where each one lives among a checkpoint's keys.

Everything here works on one (layer, expert) tensor. Megatron distributed checkpoints store GLOBAL
(unsharded) tensors, so the offline converter only uses ``to_mcore`` / ``to_hf``; the online
loader uses :meth:`Rule.tp_shard` to build one tensor-parallel rank's local tensor from HF slices
(each expert-parallel rank only meets, and so only reads, its own experts).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from loong_models import FoundationConfig

LAYER = "{i}"
EXPERT = "{e}"
# The decoder's layers, and megatron's multi-token-prediction layers (``mtp.layers.<k>.``).
_LAYERS = re.compile(r"(?:decoder|mtp)\.layers\.")
_INDEXED = re.compile(r"^(.*?(?:decoder|mtp)\.layers\.)(\d+)\.(.+)$")  # a component prefix may precede


class Split(enum.Enum):
    """How megatron's tensor parallelism splits a parameter."""

    COLUMN = 0  # output features (dim 0): QKV, fc1
    ROW = 1  # input features (dim 1): attention output projection, fc2
    REPLICATED = None  # every rank holds all of it: norms
    VOCAB = "vocab"  # dim 0, after padding the vocabulary to FoundationConfig.padded_vocab_size

    @property
    def dim(self) -> int | None:
        return 0 if self is Split.VOCAB else self.value


@dataclass(frozen=True)
class Transform:
    """HF tensors <-> one megatron tensor. ``groups`` is the number of KV groups the tensors hold
    (all of them offline; a tensor-parallel rank's share online)."""

    name: str
    fuse: Callable[[Sequence[torch.Tensor], FoundationConfig, int], torch.Tensor]
    unfuse: Callable[[torch.Tensor, FoundationConfig, int], list[torch.Tensor]]
    hf_rows: Callable[[int, FoundationConfig, int], list[int]]  # rows of each HF tensor for mcore rows


def _identity() -> Transform:
    return Transform("identity", lambda ts, c, g: ts[0], lambda t, c, g: [t], lambda rows, c, g: [rows])


def _qkv_sizes(c: FoundationConfig, groups: int) -> tuple[int, int]:
    q_per_group = c.num_attention_heads // c.query_groups
    return q_per_group * c.head_dim, c.head_dim


def _qkv_fuse(ts: Sequence[torch.Tensor], c: FoundationConfig, groups: int) -> torch.Tensor:
    q, k, v = ts
    rest = q.shape[1:]
    qg, kg = _qkv_sizes(c, groups)
    # megatron's layout: [groups, (q_per_group + 2) * head_dim, ...] = per group its queries, key, value
    parts = [q.reshape(groups, qg, *rest), k.reshape(groups, kg, *rest), v.reshape(groups, kg, *rest)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def _qkv_unfuse(t: torch.Tensor, c: FoundationConfig, groups: int) -> list[torch.Tensor]:
    rest = t.shape[1:]
    qg, kg = _qkv_sizes(c, groups)
    q, k, v = t.reshape(groups, qg + 2 * kg, *rest).split([qg, kg, kg], dim=1)
    return [x.reshape(-1, *rest).contiguous() for x in (q, k, v)]


def _qkv_rows(rows: int, c: FoundationConfig, groups: int) -> list[int]:
    qg, kg = _qkv_sizes(c, groups)
    return [groups * qg, groups * kg, groups * kg]


def _concat(n: int) -> Transform:
    return Transform(
        f"concat{n}",
        lambda ts, c, g: torch.cat(list(ts), dim=0),
        lambda t, c, g: [x.contiguous() for x in t.chunk(n, dim=0)],
        lambda rows, c, g: [rows // n] * n,
    )


IDENTITY = _identity()
QKV = Transform("qkv", _qkv_fuse, _qkv_unfuse, _qkv_rows)  # q, k, v fused per KV group (GQA)
GATE_UP = _concat(2)  # SwiGLU: fc1 = [gate; up]


@dataclass(frozen=True)
class Rule:
    mcore: str  # megatron checkpoint key
    hf: tuple[str, ...]  # HF tensor names; LAYER ("{i}") marks per-layer tensors
    split: Split
    transform: Transform = IDENTITY
    # Whether a model of this config has the tensor (e.g. no output layer with tied embeddings).
    when: Callable[[FoundationConfig], bool] | None = None
    # For per-layer tensors: whether layer i has it (dense MLP vs MoE layers); None = every layer.
    on_layer: Callable[[FoundationConfig, int], bool] | None = None
    # Megatron keeps this tensor in one dtype whatever the model's (the router's fp32 expert bias).
    dtype: torch.dtype | None = None
    # Other keys megatron gives the same tensor under another layer spec (norms that TE fuses into
    # the next linear: ``linear_q_up_proj.layer_norm_weight`` for the local ``q_layernorm.weight``).
    aliases: tuple[str, ...] = ()
    # HF's index of megatron's layer 0 of this rule: DeepSeek's MTP layer k is HF layer
    # num_hidden_layers + k (bound per config, see families.mtp_rules).
    hf_layer_offset: int = 0

    def applies(self, cfg: FoundationConfig) -> bool:
        return self.when is None or self.when(cfg)

    def has_layer(self, cfg: FoundationConfig, layer: int) -> bool:
        return self.on_layer is None or self.on_layer(cfg, layer)

    def __post_init__(self) -> None:
        if len(self.hf) != {"qkv": 3, "concat2": 2}.get(self.transform.name, 1):
            raise ValueError(
                f"rule {self.mcore}: transform {self.transform.name} does not take {len(self.hf)} tensors"
            )

    @property
    def layered(self) -> bool:
        return LAYER in self.hf[0]

    @property
    def expert(self) -> bool:
        """One tensor per routed expert (megatron: an expert axis; HF: ``{e}`` in the names)."""
        return EXPERT in self.hf[0]

    def hf_names(self, layer: int | None, expert: int | None = None) -> list[str]:
        names = [n.replace(LAYER, str(layer + self.hf_layer_offset)) for n in self.hf] if self.layered else list(self.hf)
        return [n.replace(EXPERT, str(expert)) for n in names] if self.expert else names

    # --- whole (global) tensors: the offline converter -------------------------------------

    def hf_shapes(self, mcore_shape: Sequence[int], cfg: FoundationConfig) -> list[tuple[int, ...]]:
        """The HF shapes that make a (one-layer) megatron tensor of ``mcore_shape``."""
        rows, rest = mcore_shape[0], tuple(mcore_shape[1:])
        if self.split is Split.VOCAB:
            rows = cfg.vocab_size
        return [(r, *rest) for r in self.transform.hf_rows(rows, cfg, cfg.query_groups)]

    def to_mcore(self, hf: Sequence[torch.Tensor], cfg: FoundationConfig, padded_vocab: int) -> torch.Tensor:
        t = self.transform.fuse(hf, cfg, cfg.query_groups)
        if self.split is Split.VOCAB and t.shape[0] < padded_vocab:
            t = torch.cat([t, t.new_zeros(padded_vocab - t.shape[0], *t.shape[1:])])
        return t

    def to_hf(self, t: torch.Tensor, cfg: FoundationConfig) -> list[torch.Tensor]:
        if self.split is Split.VOCAB:
            t = t[: cfg.vocab_size]
        return self.transform.unfuse(t, cfg, cfg.query_groups)

    # --- one tensor-parallel rank's share: the online loader -------------------------------

    def tp_shard(
        self,
        reader: SliceReader,
        layer: int | None,
        cfg: FoundationConfig,
        tp_rank: int,
        tp_size: int,
        padded_vocab: int,
        expert: int | None = None,
    ) -> torch.Tensor:
        """This rank's local tensor, reading only the HF slices it needs. For expert rules
        ``tp_rank`` / ``tp_size`` are the expert-tensor-parallel ones."""
        names = self.hf_names(layer, expert)
        dim = self.split.dim
        if dim is None or (tp_size == 1 and self.split is not Split.VOCAB):
            return self.to_mcore([reader.read(n) for n in names], cfg, padded_vocab)
        if self.split is Split.VOCAB:
            per_rank = padded_vocab // tp_size
            start = min(tp_rank * per_rank, cfg.vocab_size)
            t = reader.read(names[0], 0, start, min(start + per_rank, cfg.vocab_size))
            if t.shape[0] < per_rank:
                t = torch.cat([t, t.new_zeros(per_rank - t.shape[0], *t.shape[1:])])
            return t
        parts = []
        for n in names:  # each HF tensor contributes its rank-th block along the split dim
            per = reader.shape(n)[dim] // tp_size
            parts.append(reader.read(n, dim, tp_rank * per, (tp_rank + 1) * per))
        return self.transform.fuse(parts, cfg, cfg.query_groups // tp_size)


class SliceReader(Protocol):
    def shape(self, name: str) -> tuple[int, ...]: ...

    def read(
        self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None
    ) -> torch.Tensor:
        """HF tensor ``name``, or its ``[start, stop)`` range along ``dim``."""
        ...


@dataclass(frozen=True)
class Unit:
    """One (layer, expert) tensor of a rule, and where it lives in a checkpoint: ``key`` and the
    indices of the axes megatron prepends (``prefix``: stacked layer and/or expert)."""

    rule: Rule
    layer: int | None
    expert: int | None
    key: str
    prefix: tuple[int, ...]


def layer_key(mcore: str, layer: int) -> str:
    """The key megatron gives a per-layer tensor of a decoder with differing layers (after a
    composed model's component prefix, if any: ``image_encoder.decoder.layers.<i>.x``)."""
    m = _LAYERS.search(mcore)
    assert m, mcore
    return f"{mcore[: m.end()]}{layer}.{mcore[m.end() :]}"


def rule_key(key: str) -> tuple[str, int | None]:
    """``decoder.layers.3.x`` -> (``decoder.layers.x``, 3); other keys -> (key, None)."""
    m = _INDEXED.match(key)
    return (m.group(1) + m.group(3), int(m.group(2))) if m else (key, None)


def units(rules: Sequence[Rule], cfg: FoundationConfig) -> Iterator[tuple[Rule, int | None, int | None]]:
    """Every (rule, layer, expert) tensor of a model of ``cfg``, in HF's usual order: non-layer
    tensors first, then layer by layer (a layer's own tensors, then its experts one by one)."""
    num_experts = cfg.moe.num_experts if cfg.moe is not None else 0
    yield from ((r, None, None) for r in rules if not r.layered)
    for i in range(cfg.num_layers):
        here = [r for r in rules if r.layered and r.has_layer(cfg, i)]
        yield from ((r, i, None) for r in here if not r.expert)
        for e in range(num_experts):
            yield from ((r, i, e) for r in here if r.expert)


def locate(rule: Rule, layer: int | None, expert: int | None, keys: Collection[str]) -> Unit | None:
    """Where (rule, layer, expert) lives among checkpoint ``keys`` (indexed or stacked layers)."""
    for name in (rule.mcore, *rule.aliases):
        prefix: tuple[int, ...] = ()
        key = name
        if layer is not None:
            indexed = layer_key(name, layer)
            if indexed in keys:
                key = indexed
            else:
                prefix = (layer,)
        if key in keys:
            return Unit(rule, layer, expert, key, prefix + (() if expert is None else (expert,)))
    return None


@dataclass(frozen=True)
class FamilyMapping:
    """All rules of one family (registered against loong_models' family names)."""

    family: str
    rules: tuple[Rule, ...]
    # The MTP layers' own tensors (DeepSeek-V3); empty: the family has no HF layout for MTP.
    mtp: tuple[Rule, ...] = ()

    def by_mcore_key(self) -> dict[str, Rule]:
        """Every megatron key (aliases included) -> its rule."""
        return {k: r for r in self.rules for k in (r.mcore, *r.aliases)}
