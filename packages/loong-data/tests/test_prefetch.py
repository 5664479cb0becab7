"""prefetch: the same items in the same order, produced ahead; producer errors reach the consumer."""

import os
import threading
import time

import pytest

from loong_data.prefetch import prefetch, prefetch_process


def test_prefetch_yields_the_same_items_produced_ahead():
    produced = []

    def items():
        for i in range(5):
            produced.append(i)
            yield i

    it = prefetch(items(), depth=2)
    assert next(it) == 0
    time.sleep(0.2)
    assert produced == [0, 1, 2, 3]  # one consumed, two waiting, one blocked on the full queue
    assert list(it) == [1, 2, 3, 4]


def test_producer_error_is_raised_at_its_item():
    def items():
        yield 1
        raise ValueError("bad shard x.tar")

    it = prefetch(items())
    assert next(it) == 1
    with pytest.raises(ValueError, match="bad shard"):
        next(it)


def test_prefetch_runs_in_another_thread():
    def items():
        yield threading.get_ident()

    assert next(prefetch(items())) != threading.get_ident()


def test_process_prefetch_yields_the_items_in_order_from_a_child_process():
    def items():
        for i in range(4):
            yield i, os.getpid()

    got = list(prefetch_process(items, depth=2))
    assert [i for i, _ in got] == [0, 1, 2, 3]
    assert {pid for _, pid in got} != {os.getpid()}  # made in another process


def test_process_prefetch_raises_the_producers_error_at_its_item():
    def items():
        yield 1
        raise ValueError("bad shard x.tar")

    it = prefetch_process(items)
    assert next(it) == 1
    with pytest.raises(ValueError, match="bad shard x.tar"):
        next(it)
