"""A fake NPU: streams with a device timeline, and torch-like events, on a real or a virtual clock.

A kernel launched on a stream starts when the stream is free (or now) and occupies it for its duration;
the launch returns at once, like an asynchronous device launch. An event recorded on a stream completes
when the stream reaches that point. ``synchronize()`` blocks the calling thread until then (real clock)
or advances the clock (virtual clock, single-threaded driver). ``elapsed_time`` follows torch: only for
events created with ``enable_timing=True``, recorded and complete, else ``RuntimeError``.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    def now_ns(self) -> int: ...

    def sleep_until(self, t_ns: int) -> None: ...


class RealClock:
    """``time.perf_counter_ns`` with sleeping waits (releases the GIL)."""

    __slots__ = ()

    def now_ns(self) -> int:
        return time.perf_counter_ns()

    def sleep_until(self, t_ns: int) -> None:
        while True:
            left = t_ns - time.perf_counter_ns()
            if left <= 0:
                return
            time.sleep(left / 1e9)

    def sleep_for(self, dur_ns: int) -> None:
        if dur_ns > 0:
            self.sleep_until(time.perf_counter_ns() + dur_ns)


class VirtualClock:
    """A settable clock in ns. ``sleep_until`` jumps forward; it never goes back."""

    __slots__ = ("now",)

    def __init__(self, start_ns: int = 0) -> None:
        self.now = start_ns

    def now_ns(self) -> int:
        return self.now

    def sleep_until(self, t_ns: int) -> None:
        self.now = max(self.now, t_ns)

    def sleep_for(self, dur_ns: int) -> None:
        if dur_ns > 0:
            self.now += dur_ns


class Stream:
    """One in-order device queue. ``tail_ns`` is when the last launched kernel finishes."""

    __slots__ = ("_keep", "device", "kernels", "name", "tail_ns")

    def __init__(self, device: FakeNPU, name: str, keep_kernels: int = 0) -> None:
        self.name = name
        self.device = device
        self.tail_ns = 0
        self._keep = keep_kernels
        self.kernels: list[tuple[object, int, int]] = []
        """The last ``keep_kernels`` launches as ``(kind, start_ns, end_ns)`` (tests and demos)."""

    def launch(self, kind: object, duration_ns: int) -> int:
        """Queue a kernel; returns its device end time. Never blocks."""
        start = max(self.device.clock.now_ns(), self.tail_ns)
        end = start + max(0, duration_ns)
        self.tail_ns = end
        if self._keep:
            kernels = self.kernels
            kernels.append((kind, start, end))
            if len(kernels) > self._keep:
                del kernels[0]
        return end

    def point_ns(self) -> int:
        """Device time at which work launched so far has finished (an event recorded now completes then)."""
        return max(self.device.clock.now_ns(), self.tail_ns)


class FakeNPU:
    """One device: a clock and named streams. ``current_stream()`` is the compute stream."""

    def __init__(self, clock: Clock | None = None, keep_kernels: int = 0) -> None:
        self.clock: Clock = clock if clock is not None else RealClock()
        self._keep = keep_kernels
        self._streams: dict[str, Stream] = {}
        self.compute = self.stream("compute")

    def stream(self, name: str) -> Stream:
        s = self._streams.get(name)
        if s is None:
            s = self._streams[name] = Stream(self, name, self._keep)
        return s

    def current_stream(self) -> Stream:
        return self.compute

    def Event(self, enable_timing: bool = False, blocking: bool = False) -> Event:
        return Event(enable_timing=enable_timing, blocking=blocking, device=self)


_default_lock = threading.Lock()
_default_device: FakeNPU | None = None


def set_default_device(device: FakeNPU | None) -> None:
    """Make ``device`` the one ``Event()`` and ``current_stream()`` use when none is given."""
    global _default_device
    with _default_lock:
        _default_device = device


def get_default_device() -> FakeNPU:
    global _default_device
    with _default_lock:
        if _default_device is None:
            _default_device = FakeNPU()
        return _default_device


def current_stream() -> Stream:
    return get_default_device().current_stream()


class Event:
    """torch.npu.Event look-alike on a fake device."""

    __slots__ = ("_recorded", "_t", "blocking", "device", "enable_timing")

    def __init__(self, enable_timing: bool = False, blocking: bool = False, device: FakeNPU | None = None) -> None:
        self.enable_timing = enable_timing
        self.blocking = blocking
        self.device = device if device is not None else get_default_device()
        self._t = 0
        self._recorded = False

    def record(self, stream: Stream | None = None) -> None:
        """Capture the work queued so far on ``stream`` (default: the current stream)."""
        s = stream if stream is not None else self.device.current_stream()
        self._t = s.point_ns()
        self._recorded = True

    def query(self) -> bool:
        """True when the captured work has finished (or nothing was recorded, as in torch)."""
        return not self._recorded or self.device.clock.now_ns() >= self._t

    def synchronize(self) -> None:
        """Block until the captured work has finished."""
        if self._recorded:
            self.device.clock.sleep_until(self._t)

    def elapsed_time(self, end_event: Event) -> float:
        """Milliseconds from this event to ``end_event``; raises like torch when not measurable."""
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if not (self._recorded and end_event._recorded):
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        if not (self.query() and end_event.query()):
            raise RuntimeError("Both events must be completed before calculating elapsed time.")
        return (end_event._t - self._t) / 1e6

    @property
    def device_time_ns(self) -> int:
        """The device completion time (replica-only; real NPU events cannot expose this)."""
        return self._t

    @property
    def is_recorded(self) -> bool:
        return self._recorded
