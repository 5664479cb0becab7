"""Run an iterator ahead in a background thread: the next step's samples are decoded, resized and
packed while the accelerator trains on this one (PIL and numpy release the GIL for most of it);
and stage its tensors in page-locked memory there, so that the step's copies to a CUDA device are
asynchronous (a copy from pageable memory may wait for the device's queued work)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator

import torch

_DONE = object()


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


def prefetch[T](items: Iterator[T], depth: int = 1) -> Iterator[T]:
    """The items of ``items`` in order, produced up to ``depth`` ahead by a daemon thread. An
    exception in the producer is raised here, at the item where it happened. Only for iterators
    whose items do not depend on what the consumer does between items."""
    if depth < 1:
        raise ValueError(f"prefetch depth must be >= 1, got {depth}")
    box: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce() -> None:
        try:
            for item in items:
                if stop.is_set():
                    return
                box.put(item)
            box.put(_DONE)
        except BaseException as e:  # handed to the consumer
            box.put(_Failed(e))

    threading.Thread(target=produce, daemon=True, name="loong-prefetch").start()
    try:
        while True:
            item = box.get()
            if item is _DONE:
                return
            if isinstance(item, _Failed):
                raise item.error
            yield item
    finally:
        stop.set()


def pinned(steps: Iterator[list[dict]], device: torch.device | None) -> Iterator[list[dict]]:
    """Each step's micro-batches with their tensors in page-locked host memory when ``device`` is a
    CUDA device (as the steps come: inside :func:`prefetch`'s thread when it wraps this), else as
    they are."""
    if device is None or torch.device(device).type != "cuda":
        yield from steps
        return
    for microbatches in steps:
        yield [
            {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in mb.items()}
            for mb in microbatches
        ]


class _Produced(torch.utils.data.IterableDataset):
    """The items of ``make()``, iterated in a DataLoader worker process."""

    def __init__(self, make: Callable[[], Iterator]) -> None:
        self.make = make

    def __iter__(self) -> Iterator:
        return self.make()


def prefetch_process[T](make: Callable[[], Iterator[T]], depth: int = 2, pin: bool = False) -> Iterator[T]:
    """The items of ``make()`` in order, produced up to ``depth`` ahead by one forked child process
    (a torch DataLoader worker): its Python work (decoding, collating) never holds this process's
    GIL, which a host-bound training loop needs to launch kernels. Tensors arrive through shared
    memory; ``pin``: staged in page-locked memory by the DataLoader's pinning thread here (the
    child must not touch CUDA). ``make`` runs in the child: its items must not depend on this
    process's state after the fork. Producer errors are raised here, at their item. The child
    runs torch with one thread (DataLoader's rule: OpenMP's pool does not survive a fork)."""
    if depth < 1:
        raise ValueError(f"prefetch depth must be >= 1, got {depth}")
    loader = torch.utils.data.DataLoader(
        _Produced(make), batch_size=None, num_workers=1, prefetch_factor=depth, pin_memory=pin,
        multiprocessing_context="fork",
    )  # fmt: skip
    return iter(loader)
