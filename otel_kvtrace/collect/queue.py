"""A hand-off queue bounded by bytes, between the network threads and the file writer.

The receiver must never grow without bound when the disk (or the writer) is slower than the senders.
``offer`` never blocks: when the budget is used up it returns False and the network side answers
RESOURCE_EXHAUSTED / HTTP 503, so the OTLP exporters back off and retry instead of the receiver buffering.
"""

from __future__ import annotations

import collections
import threading
from typing import Generic, TypeVar

T = TypeVar("T")


class ByteBoundedQueue(Generic[T]):
    """FIFO whose total ``size`` (bytes of the queued items) stays under ``max_bytes``.

    One item is always accepted into an empty queue, so a single request larger than the budget
    (but under the receiver's request-size limit) still goes through instead of being refused forever.
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._items: collections.deque[tuple[T, int]] = collections.deque()
        self._bytes = 0
        self._cond = threading.Condition()
        self._closed = False
        self.high_water_bytes = 0

    def offer(self, item: T, size: int) -> bool:
        """Queue ``item`` unless that would exceed the budget; never blocks."""
        with self._cond:
            if self._closed:
                return False
            if self._items and self._bytes + size > self.max_bytes:
                return False
            self._items.append((item, size))
            self._bytes += size
            self.high_water_bytes = max(self.high_water_bytes, self._bytes)
            self._cond.notify()
            return True

    def take(self, timeout: float) -> T | None:
        """The oldest item, or None after ``timeout`` seconds (or at once when closed and empty)."""
        batch = self.take_many(timeout, 1)
        return batch[0] if batch else None

    def take_many(self, timeout: float, max_items: int) -> list[T]:
        """Up to ``max_items`` oldest items (waiting up to ``timeout`` for the first); [] when none came."""
        with self._cond:
            if not self._items and not self._closed:
                self._cond.wait(timeout)
            out: list[T] = []
            while self._items and len(out) < max_items:
                item, size = self._items.popleft()
                self._bytes -= size
                out.append(item)
            return out

    def close(self) -> None:
        """Refuse new items; ``take`` keeps returning what is queued, then None without waiting."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    @property
    def queued_bytes(self) -> int:
        with self._cond:
            return self._bytes


class MemoryBudget:
    """Bytes that all requests being received and decompressed at once may hold together.

    Each request reserves its body and, chunk by chunk, what it inflates to; a reservation that does not
    fit is refused (never waits), so N concurrent decompression bombs cost at most ``max_bytes``, not N
    times the per-request cap. One reservation is always granted when nothing is reserved, so a single
    request up to the per-request limit is never refused forever.
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._used = 0
        self._lock = threading.Lock()
        self.high_water_bytes = 0

    def try_reserve(self, n: int) -> bool:
        with self._lock:
            if self._used and self._used + n > self.max_bytes:
                return False
            self._used += n
            self.high_water_bytes = max(self.high_water_bytes, self._used)
            return True

    def release(self, n: int) -> None:
        with self._lock:
            self._used -= n

    @property
    def used(self) -> int:
        with self._lock:
            return self._used
