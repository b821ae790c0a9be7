"""Upper bounds for NPU completions from stream order, without any device timing.

The forward records the attention gate (at attention ``c``) and the save point (``sync_save_events[c]``,
after attention ``c``) on one in-order compute stream. A device event completes no later than any event
recorded after it on that stream has been seen complete, and the send thread synchronizes every saved
layer soon after it is recorded. So a queued task's gate or save dependency gets an upper bound long
before the task itself reaches its own ``synchronize()``:

    hi(E) = min(observed completion of E' for every E' recorded at or after E in the step)

The log is per step and per process (one gate per process upstream), appended only by the forward
thread; observers (recv/send threads) lower a slot's bound with a plain store (a lost race leaves a
larger, still valid bound). Bounds are tightened off the hot path, when the exporter drains a record.
Assumption (true for vLLM-Ascend's layerwise path): the gate and the save events are recorded on the
forward thread's current stream, and that stream does not change within a step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

FAR_FUTURE = 1 << 62
MAX_SCAN = 64
MAX_EVENTS_PER_LOG = 1 << 16
"""A step records 2 events per layer; a log this long means no step boundary is being seen (no
instrumented ``start_load_kv``): start a new one so memory stays bounded (bounds only lose reach)."""


@dataclass(slots=True)
class StreamLog:
    """Completion upper bounds of the NPU events of one step, in record order."""

    done_by: list[int] = field(default_factory=list)
    # Highest position seen complete so far (-1: none). Every entry after it is still ``FAR_FUTURE``, so
    # a bound needs to scan only up to it; an observer stores it after its ``done_by`` entry, so a racing
    # reader at worst misses the newest observation (a looser, still valid bound).
    observed: int = -1

    def append(self) -> int:
        """Register a newly recorded event; returns its position (forward thread only)."""
        self.done_by.append(FAR_FUTURE)
        return len(self.done_by) - 1

    def observe(self, position: int, done_at: int) -> None:
        """The event at ``position`` was seen complete at ``done_at`` (synchronize return, query True)."""
        if done_at < self.done_by[position]:
            self.done_by[position] = done_at
        if position > self.observed:
            self.observed = position

    def upper_bound(self, position: int) -> int:
        """Earliest observed completion of this event or of any of the next ``MAX_SCAN`` recorded after it.

        The scan is capped so its cost stays flat when no step boundary is seen (a smaller window only
        gives a looser, still valid bound); a real step records 2 events per layer, well inside it.
        """
        if position >= self.observed:  # nothing after it seen complete: the scan would find only this entry
            return self.done_by[position] if position == self.observed else FAR_FUTURE
        later = self.done_by[position : min(position + MAX_SCAN, self.observed + 1)]
        return min(later)


def next_position(holder: Any) -> StreamPosition:
    """Register a newly recorded NPU event in ``holder.stream_log`` (the runtime's current step log)."""
    log = holder.stream_log
    if len(log.done_by) >= MAX_EVENTS_PER_LOG:
        log = holder.stream_log = StreamLog()
    return StreamPosition(log, log.append())


@dataclass(slots=True, frozen=True)
class StreamPosition:
    """Where a dependency's NPU event sits in its step's stream log (kept on the task record)."""

    log: StreamLog
    position: int

    def upper_bound(self) -> int:
        return self.log.upper_bound(self.position)


def tighten_bounds(record: Any) -> bool:
    """Lower each NPU dependency's upper bound of ``record`` to its ``StreamPosition`` marks' stream-order
    bound (``StreamLog.upper_bound``, inlined: this runs once per shipped task on the recording thread).

    The one home of the rule, for the ring writer (at ship) and ``Runtime.resolve`` (in-process export).
    Only numbers are read (the live step log), nothing is allocated but the scanned slice. Returns True
    when other marks (device-timing events, ``npu_timing.py``) remain for the caller; marks are not removed.
    """
    others = False
    deps = record.deps
    for dep, mark in record.npu_marks:
        if type(mark) is not StreamPosition:
            others = True
            continue
        p = mark.position
        log = mark.log
        last = log.observed
        if p >= last:  # nothing recorded after it was seen complete yet: no scan
            if p > last:
                continue  # not even itself (a lost race): the wait's own bound stands
            bound = log.done_by[p]
        else:  # entries after ``last`` are all unobserved: the window ends there (at most MAX_SCAN)
            bound = min(log.done_by[p : last + 1 if last < p + MAX_SCAN else p + MAX_SCAN])
        hi = 2 * dep + 1
        if bound < deps[hi]:
            record.has_dep |= 1 << dep
            lo = deps[hi - 1]
            deps[hi] = bound if bound > lo else lo
    return others
