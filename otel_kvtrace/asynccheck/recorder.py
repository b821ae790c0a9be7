"""Hot-path stamp buffer for the engine loop: preallocated, bounded, lock-free, with a drop counter.

A stamp is ``(kind, t_ns, a, b)`` written into preallocated ``array('q')`` columns of the current
generation. Claiming a slot is ``next()`` on an ``itertools.count`` (atomic under the GIL), so the
engine thread and the output thread (``get_output``) can both stamp without a lock. The kind is stored
last and doubles as the "slot written" flag. When a generation is full, stamps are dropped and counted
until the exporter swaps in a fresh generation (the swap and the allocation happen off the hot path).
"""

from __future__ import annotations

import itertools
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum

from otel_kvtrace.record.recorder import count_value

DEFAULT_CAPACITY = 65536


class StampKind(IntEnum):
    """What a stamp marks. Interval kinds carry ``t`` = start, ``a`` = end, ``b`` = step."""

    SCHED_BEGIN = 1  # a = 1 when the step ran through the batch queue (async engine loop)
    SCHED_END = 2
    LAUNCH_BEGIN = 3
    LAUNCH_END = 4
    DONE = 5  # get_output return; a = 1 when it ran off the engine thread (an output thread)
    UPDATE_BEGIN = 6
    UPDATE_END = 7
    COMPUTE = 8
    COMM = 9
    SAMPLE_BEGIN = 11  # Executor.sample_tokens (the sampling launch since vLLM 0.23; part of the host launch)
    SAMPLE_END = 12
    READY = 10  # t = first query() true, a = last query() false (or registration), b = registration time
    WORKER_CALL = 13  # a worker's execute_model (b = 0) / sample_tokens (b = 1): t = start, a = end


class _Generation:
    __slots__ = ("cap", "claim", "kind", "t", "a", "b")

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.claim = itertools.count()
        self.kind = array("b", bytes(cap))
        self.t = array("q", bytes(8 * cap))
        self.a = array("q", bytes(8 * cap))
        self.b = array("q", bytes(8 * cap))


@dataclass(slots=True)
class Stamp:
    kind: StampKind
    t: int
    a: int
    b: int


class StampBuffer:
    """Bounded stamp store written by instrumented threads and drained by the exporter."""

    def __init__(self, *, capacity: int = DEFAULT_CAPACITY, clock: Callable[[], int] = time.perf_counter_ns) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.clock = clock
        self._gen = _Generation(capacity)
        self._drops = itertools.count()
        self._outputs_dropped = itertools.count()  # by the output-ready watcher (atomic under the GIL)

    # ---- hot path -----------------------------------------------------------------------------------
    def stamp(self, kind: int, a: int = 0, b: int = 0) -> None:
        """Record ``kind`` at the current clock time (``put`` inlined: this is the hot path)."""
        t = self.clock()
        gen = self._gen
        i = next(gen.claim)
        if i >= gen.cap:
            next(self._drops)
            return
        gen.t[i] = t
        gen.a[i] = a
        gen.b[i] = b
        gen.kind[i] = kind

    def put(self, kind: int, t: int, a: int = 0, b: int = 0) -> None:
        """Record a stamp with an explicit time (device intervals come with their own times)."""
        gen = self._gen
        i = next(gen.claim)
        if i >= gen.cap:
            next(self._drops)
            return
        gen.t[i] = t
        gen.a[i] = a
        gen.b[i] = b
        gen.kind[i] = kind

    # ---- exporter side ------------------------------------------------------------------------------
    def drain(self, settle_s: float = 0.001) -> list[Stamp]:
        """All stamps written so far, in claim order; the buffer starts a fresh generation.

        A writer that read the old generation just before the swap finishes within a few bytecodes;
        ``settle_s`` gives it that time. A slot still unwritten after it counts as dropped.
        """
        old = self._gen
        self._gen = _Generation(self.capacity)
        if settle_s:
            time.sleep(settle_s)
        claimed = min(count_value(old.claim), old.cap)
        out: list[Stamp] = []
        for i in range(claimed):
            kind = old.kind[i]
            if kind == 0:
                next(self._drops)
                continue
            out.append(Stamp(StampKind(kind), old.t[i], old.a[i], old.b[i]))
        return out

    @property
    def dropped(self) -> int:
        """Stamps lost because a generation was full (cumulative)."""
        return count_value(self._drops)

    def output_dropped(self) -> None:
        """Hot path: the output-ready watcher had ``MAX_PENDING`` outputs in flight and let one go."""
        next(self._outputs_dropped)

    @property
    def outputs_dropped(self) -> int:
        """Outputs whose ready time was not watched (cumulative); exported as ``ATTR_OUTPUTS_DROPPED``."""
        return count_value(self._outputs_dropped)

