"""prefetch: the same items in the same order, produced ahead; producer errors reach the consumer."""

import threading
import time

import pytest

from loong_data.prefetch import prefetch


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
