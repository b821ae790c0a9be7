"""What every wrapper needs at hand: the recorder, the clock, device timing, per-thread queue lookup."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from otel_kvtrace import config
from otel_kvtrace.instrument.state import QueueState
from otel_kvtrace.instrument.stream_order import StreamLog, StreamPosition, tighten_bounds
from otel_kvtrace.record.model import TaskRecord
from otel_kvtrace.record.recorder import Recorder


def default_run_id() -> str:
    """``OTEL_KVTRACE_RUN_ID`` or ``{host}-{pid}-{start_epoch_s}`` (see docs/schema.md)."""
    return config.run_id()


@dataclass(slots=True)
class Runtime:
    """Shared by all wrappers of one tracing session."""

    recorder: Recorder
    run_id: str
    npu_timing: Any = None  # NpuTiming | None; created lazily from the first NPU event type seen
    npu_timing_wanted: bool = False
    npu_event_class: Any = None  # hint for creating timing events before any NPU event was seen
    state_by_thread: dict[int, QueueState] = field(default_factory=dict)
    queues: list[QueueState] = field(default_factory=list)
    workers: list[Any] = field(default_factory=list)  # objects that got a WorkerState attribute
    # Called once per worker after its transfer threads are attached (e.g. to add its config and ranks
    # to the resource). Exceptions disable tracing like any other instrumentation failure.
    on_worker_attached: list[Callable[[Any], None]] = field(default_factory=list)
    # Patch points left unwrapped because compiled probes cover them, to be wrapped once a recv thread on the
    # wrapper path attaches (the gate's wait when the key path is traced next to a compiled GVA path).
    deferred: dict[str, Callable[[], None]] = field(default_factory=dict)
    # NPU events of the current step in compute-stream order (a new log per start_load_kv).
    stream_log: StreamLog = field(default_factory=StreamLog)

    @property
    def clock(self) -> Callable[[], int]:
        return self.recorder.clock

    def resolve(self, record: TaskRecord) -> None:
        """Tighten a record's NPU dependencies off the hot path (``Recorder.npu_resolver``).

        First the stream-order upper bounds (always: ``stream_order.tighten_bounds``), then exact device
        times (``OTEL_KVTRACE_NPU_TIMING``), which are clamped into the bounds.
        """
        marks = record.npu_marks
        if tighten_bounds(record) and self.npu_timing is not None:
            marks[:] = [m for m in marks if type(m[1]) is not StreamPosition]
            self.npu_timing.resolve(record)
        marks.clear()

    def fail(self, exc: BaseException) -> None:
        """An instrumentation bug: turn tracing off, keep the host running."""
        where = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        self.recorder.disable(where)
