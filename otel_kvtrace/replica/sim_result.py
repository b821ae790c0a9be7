"""What a virtual run returns: per-task records, per-step forward figures, and helpers over them."""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field

from otel_kvtrace.record.model import NO_TIME, Outcome, QueueInfo, TaskRecord
from otel_kvtrace.replica.config import ReplicaConfig
from otel_kvtrace.replica.layout import ReuseLayout


@dataclass(slots=True)
class StepOutcome:
    """Forward-side figures of one step (ns on the virtual clock)."""

    step: int
    start_ns: int
    end_ns: int
    consumer_wait_ns: int
    lease_release_ns: int = NO_TIME


@dataclass(slots=True)
class SimResult:
    """Everything one virtual run produced. Times are virtual ns (0 = run start)."""

    config: ReplicaConfig
    layout: ReuseLayout
    recv: list[TaskRecord]
    """Recv tasks in enqueue (``seq``) order."""
    send: list[TaskRecord]
    steps: list[StepOutcome]
    recv_queue: QueueInfo
    send_queue: QueueInfo
    error: str | None = None
    events: int = 0
    copy_intervals: list[tuple[int, int, int, int]] = field(default_factory=list)
    """``(step, layer, start_ns, end_ns)`` of every load copy, for invariant checks."""

    @property
    def num_tasks(self) -> int:
        return len(self.recv) + len(self.send)

    @property
    def end_ns(self) -> int:
        return self.steps[-1].end_ns if self.steps else 0

    @property
    def total_consumer_wait_ns(self) -> int:
        return sum(s.consumer_wait_ns for s in self.steps)


def ready_time(rec: TaskRecord) -> int:
    """``max(t_enqueue, every dependency's upper bound)`` (docs/schema.md ``ts.ready``)."""
    t = rec.t_enqueue
    deps = rec.deps
    for i in range(1, len(deps), 2):
        t = max(t, deps[i])
    return t


def fill_depths(records: list[TaskRecord]) -> None:
    """``queue_depth_at_enqueue`` / ``inflight_at_enqueue`` from FIFO dequeue and completion times.

    In one FIFO, dequeue and completion times are non-decreasing in ``seq``, so the tasks ahead that are
    no longer queued (or in flight) form a prefix found by bisection. A task never dequeued (or never
    completed, e.g. after a fatal error) counts as still queued.
    """
    never = 1 << 62
    error = Outcome.ERROR
    deq_t = [r.t_dequeue if r.t_dequeue >= 0 else never for r in records]
    done_t = [r.t_complete if r.t_complete >= 0 and r.outcome != error else never for r in records]
    for idx, rec in enumerate(records):
        t = rec.t_enqueue
        rec.queue_depth_at_enqueue = idx - bisect_right(deq_t, t, 0, idx)
        rec.inflight_at_enqueue = idx - bisect_right(done_t, t, 0, idx)
