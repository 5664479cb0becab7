"""The parity tests would catch a wrong fused-weight layout: for every fused transform, a
mutated conversion (the layout a careless mapping would write: q, k, v back to back instead of per
KV group, [up; gate] instead of [gate; up], HF's packed ViT qkv taken as megatron's per-head
layout) still round-trips bit-identically, so only the logits against HF can tell, and they do."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from loong_ckpt.mapping import GATE_UP, QKV, Transform
from loong_ckpt.testing import get_converted, get_converted_vlm, logits_in_process
from loong_ckpt.vlm import PACKED_QKV

TOL = 1e-4  # the parity tests' tolerance (test_convert.py)


@contextlib.contextmanager
def mutated(transform: Transform, fuse, unfuse):
    """``transform`` (shared by every rule that names it) with another layout, restored after."""
    saved = dataclasses.astuple(transform)
    object.__setattr__(transform, "fuse", fuse)  # frozen: the rules hold this very instance
    object.__setattr__(transform, "unfuse", unfuse)
    try:
        yield
    finally:
        for f, value in zip(dataclasses.fields(transform), saved):
            object.__setattr__(transform, f.name, value)


def _blockwise_qkv():
    def fuse(ts, c, groups):
        return torch.cat(list(ts), dim=0)

    def unfuse(t, c, groups):
        return [x.contiguous() for x in t.split(QKV.hf_rows(t.shape[0], c, groups), dim=0)]

    return fuse, unfuse


def _up_gate():
    return (lambda ts, c, g: torch.cat([ts[1], ts[0]], dim=0),
            lambda t, c, g: [x.contiguous() for x in reversed(t.chunk(2, dim=0))])  # fmt: skip


def _packed_as_is():
    return lambda ts, c, g: ts[0], lambda t, c, g: [t]


MUTATIONS = {
    "qkv-blockwise": (QKV, _blockwise_qkv, "llama"),
    "gate-up-swapped": (GATE_UP, _up_gate, "qwen2"),
    "vit-qkv-not-interleaved": (PACKED_QKV, _packed_as_is, "qwen2.5-vl"),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_parity_catches_a_wrong_fused_layout(name, tmp_path, tmp_path_factory):
    from loong_ckpt import hf_to_mcore

    transform, mutation, family = MUTATIONS[name]
    c = get_converted_vlm(tmp_path_factory) if family == "qwen2.5-vl" else get_converted(tmp_path_factory, family)
    right = logits_in_process(c.ckpt, c.tokens)
    assert (right - c.ref).abs().max().item() <= TOL  # the parity test passes on the real layout
    with mutated(transform, *mutation()):
        hf_to_mcore(c.hf, tmp_path / "ckpt", progress=False)
    wrong = logits_in_process(tmp_path / "ckpt", c.tokens)
    # well past the tolerance (a mutated ViT moves the random tiny VLM's logits by ~80x TOL, the LLM ones more)
    assert (wrong - c.ref).abs().max().item() > 10 * TOL, f"{name}: the parity test would not notice"
