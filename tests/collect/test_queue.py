"""ByteBoundedQueue: the receiver's only buffer, bounded by bytes and never blocking the network side."""

from __future__ import annotations

import pytest

from otel_kvtrace.collect.queue import ByteBoundedQueue


def test_refuses_beyond_budget_and_accepts_again_after_take() -> None:
    q: ByteBoundedQueue[str] = ByteBoundedQueue(max_bytes=10)
    assert q.offer("a", 6)
    assert not q.offer("b", 5)
    assert q.offer("c", 4)
    assert q.queued_bytes == 10 and q.high_water_bytes == 10
    assert q.take(0) == "a"
    assert q.offer("b", 5)
    assert [q.take(0), q.take(0), q.take(0)] == ["c", "b", None]


def test_one_oversized_item_fits_an_empty_queue() -> None:
    q: ByteBoundedQueue[str] = ByteBoundedQueue(max_bytes=10)
    assert q.offer("big", 50)
    assert not q.offer("small", 1)


def test_close_refuses_new_items_but_keeps_queued_ones() -> None:
    q: ByteBoundedQueue[int] = ByteBoundedQueue(max_bytes=100)
    q.offer(1, 1)
    q.close()
    assert not q.offer(2, 1)
    assert q.take(5) == 1
    assert q.take(5) is None  # closed and empty: returns at once


def test_rejects_non_positive_budget() -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        ByteBoundedQueue(0)
