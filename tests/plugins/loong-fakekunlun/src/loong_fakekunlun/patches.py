"""This backend's contribution to loong-xpu's patch manifest (``Accelerator.extra_patches``).

Kunlun's megatron plugin replaces megatron's CUDA RNG tracker (``CudaRNGStatesTracker``) with a
vendor one. This stand-in does the same with a subclass that behaves identically and counts the
forks it serves, so a test sees that the manifest entry was applied and used."""

from __future__ import annotations

from collections import Counter

from loong_xpu import Patch


def rng_tracker_class(calls: Counter) -> type:
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    class FakeKunlunRNGStatesTracker(CudaRNGStatesTracker):
        def add(self, name, seed):
            calls["rng_tracker.add"] += 1
            return super().add(name, seed)

        def fork(self, name="model-parallel-rng"):
            calls["rng_tracker.fork"] += 1
            return super().fork(name)

    return FakeKunlunRNGStatesTracker


def extra_patches(calls: Counter) -> tuple[Patch, ...]:
    return (
        Patch(
            "megatron.core.tensor_parallel.random:CudaRNGStatesTracker",
            "the vendor RNG tracker (Kunlun keeps TP RNG streams in its own generators); "
            "megatron's initialize_rng_tracker() instantiates whatever this name holds",
            lambda accel: rng_tracker_class(calls),
        ),
    )
