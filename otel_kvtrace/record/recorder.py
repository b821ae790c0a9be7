"""The hot-path recorder: pooled task records, a bounded hand-off to the exporter, a drop counter.

Every method that runs on an instrumented thread (``new_record``, ``submit``) is a few list/deque
operations: no locks (deque ``append``/``popleft`` and ``next()`` on ``itertools.count`` are atomic under
the GIL), no formatting, no OTel objects. When the exporter falls behind, finished records are dropped
and counted instead of blocking the host thread or growing memory.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from otel_kvtrace.record.model import TaskRecord
from otel_kvtrace.record.ring import consumer_stages as _consumer_stages

logger = logging.getLogger("otel_kvtrace")

DEFAULT_CAPACITY = 16384


@dataclass(slots=True, frozen=True)
class ClockAnchor:
    """One (recorder clock, epoch) pair taken together; converts clock stamps to epoch ns at export."""

    clock_ns: int
    epoch_ns: int

    @classmethod
    def take(cls, clock: Callable[[], int]) -> ClockAnchor:
        # Bracket the epoch read by two clock reads and use the midpoint: halves the skew.
        before = clock()
        epoch = time.time_ns()
        after = clock()
        return cls((before + after) // 2, epoch)

    def to_epoch(self, stamp: int) -> int:
        return stamp - self.clock_ns + self.epoch_ns


class Recorder:
    """Pools ``TaskRecord`` objects and queues finished ones for the background exporter."""

    def __init__(
        self,
        *,
        capacity: int = DEFAULT_CAPACITY,
        clock: Callable[[], int] = time.perf_counter_ns,
        anchor: ClockAnchor | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.clock = clock
        self.anchor = anchor if anchor is not None else ClockAnchor.take(clock)
        self.enabled = True
        self._ready: deque[TaskRecord] = deque()
        self._pool: deque[TaskRecord] = deque()
        self._drops = itertools.count()
        self._submitted = itertools.count()
        self._disabled_reason: str | None = None
        # Resolves ``TaskRecord.npu_marks`` into exact device times; runs in ``drain`` (exporter thread).
        self.npu_resolver: Callable[[TaskRecord], None] | None = None
        self._disable_lock = threading.Lock()

        # Set by ``attach_ring``: records leave the process through a shared-memory ring to the
        # exporter agent instead of the in-process hand-off.
        self.ring: Any = None

    def attach_ring(self, writer: Any) -> None:
        """Ship records through ``writer`` (a ``RingWriter``) from now on; ``None`` goes back in-process.

        With a ring, ``submit``/``submit_first`` become ``_ship(False, ...)``/``_ship(True, ...)`` on the
        instance: the writer's native shipper (``RingWriter.native_shipper``: ``_ship`` in C, no Python frame
        for the common task) when it has one, else ``functools.partial`` objects over ``_ship`` (one frame)."""
        import functools

        self.ring = writer
        if writer is None:
            for name in ("submit", "submit_first", "submit_consumer"):
                self._unset(name)
        else:
            writer.resolver = self._resolve_timing
            native = getattr(writer, "native_shipper", None)
            for name, awaiting in (("submit", False), ("submit_first", True)):
                ship = native(self, awaiting) if native is not None else None
                setattr(self, name, ship if ship is not None else functools.partial(self._ship, awaiting))
            # The forward's release in C (``RingWriter.native_releaser``), this class's ``submit_consumer`` its
            # reference and fallback; without a native shipper the class's method itself. (``self.submit``, not
            # ``self.__dict__``: reading ``__dict__`` materialises the instance dict, and every attribute load of
            # this recorder on every thread then takes the generic path: +240 instructions per add_request.)
            releaser = getattr(writer, "native_releaser", None)
            release = (releaser(self.submit, functools.partial(type(self).submit_consumer, self))
                       if releaser is not None else None)
            if release is not None:
                self.submit_consumer = release  # type: ignore[method-assign]
            else:
                self._unset("submit_consumer")  # a previous ring's releaser: the class's method again

    def _unset(self, name: str) -> None:
        """The instance's own ``name`` removed, so the class's method is found again (``del``, not
        ``__dict__.pop``: reading ``__dict__`` materialises it, see ``attach_ring``)."""
        try:
            delattr(self, name)
        except AttributeError:
            pass

    def after_fork(self) -> None:
        """In a forked child: the parent's pending records and counts are not this process's."""
        self._ready.clear()
        self._drops = itertools.count()
        self._submitted = itertools.count()
        if self.ring is not None:  # a native shipper counts into the counter it was made with
            self.attach_ring(self.ring)

    # ---- hot path -------------------------------------------------------------------------------
    def new_record(self) -> TaskRecord:
        """A blank record, from the pool when one is free."""
        try:
            return self._pool.pop()
        except IndexError:
            return TaskRecord()

    def submit(self, record: TaskRecord) -> None:
        """Hand a finished record to the exporter; drop and count it if the hand-off is full.

        The length check and the append are not one atomic step, so with k recording threads the
        hand-off can hold at most ``capacity + k - 1`` records: still bounded, and lock-free.
        """
        if self.ring is not None:
            self._ship(False, record)
            return
        if len(self._ready) >= self.capacity:
            next(self._drops)
            return
        self._ready.append(record)
        next(self._submitted)

    def submit_first(self, record: TaskRecord) -> None:
        """The recv thread finished a task the forward's consumer wait still holds.

        With a ring the task leaves now (flagged as awaiting its consumer wait, which follows in a
        small message from ``submit_consumer``), so the forward thread never packs a whole task.
        In-process, nothing happens until the last holder calls ``submit_consumer``.
        """
        if self.ring is not None:
            self._ship(True, record)

    def submit_consumer(self, record: TaskRecord, reason: int) -> None:
        """The forward released a task after ``submit_first``: its consumer wait, or ``reason`` it has none.

        With a ring whose writer has the native packer, ``attach_ring`` installs ``_ringpack.Releaser`` on the
        instance instead (the same in C, this method its reference and the fallback for what it declines)."""
        ring = self.ring
        if ring is None:
            record.consumer_release = reason
            self.submit(record)
            return
        try:
            ring.write_cwait(record, reason, _consumer_stages(record.stages))
        except Exception as exc:  # noqa: BLE001 - never into the host thread
            self.disable(f"ring write failed: {exc!r}")
        self._recycle_one(record)

    def _ship(self, awaiting: bool, record: TaskRecord, native: bool = True) -> None:
        """One finished task into the ring (the reference of the native shipper, ``_ringpack.Shipper``, which
        calls it with ``native=False`` for a task ``Packer.ship`` declined: then not tried again)."""
        ring = self.ring
        if ring is None:  # the ring was detached meanwhile (shutdown, fork fallback): in-process
            if not awaiting:
                Recorder.submit(self, record)
            return
        try:
            ok = ring.write_task(record, awaiting, native=native)  # bounds, summary index, one pack_into, commit
        except Exception as exc:  # noqa: BLE001 - never into the host thread
            self.disable(f"ring write failed: {exc!r}")
            ok = False
        if ok:
            next(self._submitted)
        else:
            self._ring_drop(ring)
        if not awaiting and len(self._pool) < self.capacity:  # _recycle_one, inlined
            record.reset()
            self._pool.append(record)

    def _resolve_timing(self, record: TaskRecord) -> None:
        """Device-timing marks of a task about to be written (``OTEL_KVTRACE_NPU_TIMING`` only)."""
        resolver = self.npu_resolver
        if resolver is not None:
            resolver(record)

    def _ring_drop(self, ring: Any) -> None:
        next(self._drops)
        try:
            ring.publish_dropped(count_value(self._drops))  # exact; the agent reports it
        except Exception:  # noqa: BLE001 - the ring was released meanwhile (shutdown)
            pass
        if not ring.overflow_logged:
            ring.overflow_logged = True
            logger.warning(
                "otel-kvtrace: exporter agent ring full (agent dead or behind): task records are dropped "
                "and counted; recording threads are not blocked"
            )

    def _recycle_one(self, rec: TaskRecord) -> None:
        if len(self._pool) < self.capacity:
            rec.reset()
            self._pool.append(rec)

    # ---- exporter side --------------------------------------------------------------------------
    def drain(self, limit: int) -> list[TaskRecord]:
        """Up to ``limit`` finished records, oldest first."""
        out: list[TaskRecord] = []
        ready = self._ready
        for _ in range(min(limit, len(ready))):
            out.append(ready.popleft())
        resolver = self.npu_resolver
        if resolver is not None:
            for rec in out:
                if rec.npu_marks:
                    try:
                        resolver(rec)
                    except Exception as exc:  # a device-time failure must not lose the record
                        logger.debug("otel-kvtrace: NPU time resolution failed: %r", exc)
        return out

    def recycle(self, records: list[TaskRecord]) -> None:
        """Return exported records to the pool (bounded by ``capacity``)."""
        pool = self._pool
        for rec in records:
            if len(pool) >= self.capacity:
                break
            rec.reset()
            pool.append(rec)

    @property
    def pending(self) -> int:
        return len(self._ready)

    @property
    def dropped(self) -> int:
        """Records dropped because the exporter fell behind (cumulative)."""
        return count_value(self._drops)

    @property
    def submitted(self) -> int:
        return count_value(self._submitted)

    def count_drop(self, n: int = 1) -> None:
        """Count records lost elsewhere (e.g. an export batch that failed)."""
        for _ in range(n):
            next(self._drops)

    # ---- failure containment --------------------------------------------------------------------
    def disable(self, reason: str) -> None:
        """Stop recording after an internal error; logs once. Never raises."""
        with self._disable_lock:
            if not self.enabled:
                return
            self.enabled = False
            self._disabled_reason = reason
        logger.error("otel-kvtrace: tracing disabled after an internal error: %s", reason)

    @property
    def disabled_reason(self) -> str | None:
        return self._disabled_reason


def count_value(counter: itertools.count) -> int:
    """Current value of an ``itertools.count`` (a lock-free counter: ``next()`` is atomic under the GIL)."""
    # itertools.count has no peek; its reduce tuple carries the next value without advancing it.
    return int(counter.__reduce__()[1][0])  # type: ignore[index]
