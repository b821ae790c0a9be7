"""Optional exact device times (``OTEL_KVTRACE_NPU_TIMING=1``).

Next to each upstream NPU event we care about (save point, attention gate) we record our own
timing-enabled event on the same stream. The recording threads never wait on the device: the exporter
thread later asks ``calibration.elapsed_time(mark)`` for marks that ``query()`` reports complete and maps
the result to the host clock through one calibration event synchronized once, at attach time.
Cost to know before turning it on: torch_npu's ``elapsed_time`` flushes the task queues of all streams
(``emptyAllNPUStream``) before its event synchronize, so each resolution can delay kernel launches of the
forward thread a little; that is why this mode is opt-in. Without it, NPU completions are exported as
bounds, tightened by stream order (``stream_order.py``; see docs/schema.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from otel_kvtrace.record.model import TaskRecord


class NpuTiming:
    """Maps timing-enabled device events to the recorder's clock."""

    def __init__(self, event_type: Callable[..., Any], clock: Callable[[], int]) -> None:
        self._event_type = event_type
        calibration = event_type(enable_timing=True)
        calibration.record()
        calibration.synchronize()  # once, at attach: anchors device time to the host clock
        # The synchronize return is the tight end: if the stream was busy, the event completed just
        # before it (a midpoint would be off by half the wait); if idle, both ends are microseconds apart.
        self._calibration = calibration
        self._calibration_host_ns = clock()

    def mark(self, *record_args: Any, **record_kwargs: Any) -> Any:
        """Record a timing event right behind an upstream event (same stream arguments)."""
        event = self._event_type(enable_timing=True)
        event.record(*record_args, **record_kwargs)
        return event

    def device_time_ns(self, mark: Any) -> int | None:
        """Host-clock time at which the device reached ``mark``; ``None`` if not complete yet."""
        if not mark.query():
            return None
        return self._calibration_host_ns + int(self._calibration.elapsed_time(mark) * 1e6)

    def resolve(self, record: TaskRecord) -> None:
        """Replace bounded NPU dependencies of ``record`` by exact device times (clamped to bounds)."""
        for dep, mark in record.npu_marks:
            exact = self.device_time_ns(mark)
            if exact is None:
                continue
            lo, hi = record.dep_lo(dep), record.dep_hi(dep)
            if lo >= 0 and exact < lo:
                exact = lo
            if hi >= 0 and exact > hi:
                exact = hi
            record.dep_exact(dep, exact)
        record.npu_marks.clear()
