"""The send thread's saves, for the replay's save times: one FIFO server, like the recv thread.

A load that waits on layer L's save waits for the send thread to finish it. The send thread serves
saves in enqueue order, so when the replayed forward issues saves earlier, a save queued behind a slow
one still completes when the send thread gets to it. Save times are therefore replayed as
``R'_j = max(A'_j, R'_(j-1)) + c_j`` per step: ``A'_j`` is the recorded issue time moved by the replayed
forward's shift at layer ``L_j``, ``c_j = complete_j - max(enqueue_j, complete_(j-1))`` the recorded
service time (with the dispatch gap). With the forward as recorded this gives the recorded times back.

The send thread synchronizes the save's NPU event (``save_npu_sync``) before its copy: that is a wait
on the device's progress, not service. A save served at once after its issue waits there for the
layer's device work (hol: 220 us); the same save queued behind another one under FIFO finds the device
done (1 us). So ``c_j`` is split at the sync: ``R'_j = max(S'_j + pre_j, A'_j + dev_j) + post_j`` with
``S'_j = max(A'_j, R'_(j-1))``; ``dev_j`` (device lag after the issue) is exact where the recorded sync
blocked (its end), else at most the sync start and taken as ``min(that bound, the queue's median
device lag over the syncs that blocked)`` (:func:`device_lags`). Found comparing the replayed
``gate_group`` with the live one: the replay served layer 1's save 210-240 us early.
Input: the ``kvtrace.send.task`` spans and their ``save_npu_sync`` and ``backend_submit`` children (docs/schema.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True, frozen=True)
class SaveTask:
    """One recorded save (send-thread task), absolute ns."""

    step: int
    layer_id: int
    enqueue_ns: int
    complete_ns: int
    sync_start_ns: int | None = None
    sync_end_ns: int | None = None
    """The ``save_npu_sync`` stage (the send thread's wait for the save's NPU event); None: not recorded."""
    copy_start_ns: int | None = None
    copy_end_ns: int | None = None
    """The ``backend_submit`` stage (the save's copy; the send thread sleeps in it and wakes behind the
    GIL, :mod:`otel_kvtrace.whatif.gil`); None: not recorded."""


SYNC_BLOCKED_NS = 20_000
"""A recorded NPU sync longer than this blocked on the device (an unblocked one takes 1-4 us here)."""


def device_lags(saves: list[SaveTask]) -> list[int | None]:
    """Per save, the device's lag after the issue (its event's time minus the enqueue), None without a
    recorded sync: exact where the sync blocked (its end); else at most the sync start, taken as
    min(that bound, the median lag of the saves whose sync blocked)."""
    exact = [sv.sync_end_ns - sv.enqueue_ns for sv in saves if _blocked(sv)]  # type: ignore[operator]
    typical = sorted(exact)[len(exact) // 2] if exact else None
    out: list[int | None] = []
    for sv in saves:
        if sv.sync_start_ns is None or sv.sync_end_ns is None:
            out.append(None)
        elif _blocked(sv):
            out.append(sv.sync_end_ns - sv.enqueue_ns)
        else:
            bound = sv.sync_start_ns - sv.enqueue_ns
            out.append(bound if typical is None else min(bound, typical))
    return out


def _blocked(sv: SaveTask) -> bool:
    return sv.sync_start_ns is not None and sv.sync_end_ns is not None \
        and sv.sync_end_ns - sv.sync_start_ns > SYNC_BLOCKED_NS


def _within(start: Any, end: Any, done: int) -> tuple[int | None, int | None]:
    """A child stage's (start, end), or (None, None) when absent or ending after the save completed."""
    return (int(start), int(end)) if start is not None and end is not None and end <= done else (None, None)


def process_key(queue: str) -> str:
    """The part of a queue id naming the process and ranks (the thread name dropped): recv and send
    queues of one worker share it."""
    return queue.rsplit("/", 1)[0]


def saves_from_duckdb(con: Any) -> dict[str, list[SaveTask]]:
    """Recorded saves per process key, in enqueue order. Empty when the traces hold no send tasks."""
    try:
        rows = con.execute(
            "SELECT s.attrs['kvtrace.queue'], CAST(s.attrs['kvtrace.step'] AS BIGINT), "
            "CAST(s.attrs['kvtrace.layer_id'] AS BIGINT), CAST(s.attrs['kvtrace.ts.enqueue'] AS BIGINT), "
            "CAST(s.attrs['kvtrace.ts.complete'] AS BIGINT), "
            "min(c.start_ns) FILTER (WHERE c.name = 'save_npu_sync'), "
            "max(c.end_ns) FILTER (WHERE c.name = 'save_npu_sync'), "
            "min(c.start_ns) FILTER (WHERE c.name = 'backend_submit'), "
            "max(c.end_ns) FILTER (WHERE c.name = 'backend_submit') "
            "FROM spans s LEFT JOIN spans c ON c.trace_id = s.trace_id AND c.parent_span_id = s.span_id "
            "AND c.name IN ('save_npu_sync', 'backend_submit') WHERE s.name = 'kvtrace.send.task' "
            "AND s.attrs['kvtrace.ts.complete'] IS NOT NULL AND s.attrs['kvtrace.ts.enqueue'] IS NOT NULL "
            "GROUP BY s.span_id, 1, 2, 3, 4, 5 ORDER BY 1, 4").fetchall()
    except Exception:  # no spans view (a tasks-only input): saves stay as recorded on the recv side
        return {}
    out: dict[str, list[SaveTask]] = {}
    for queue, step, layer, enq, done, sync0, sync1, copy0, copy1 in rows:
        if queue is None or step is None or layer is None:
            continue
        out.setdefault(process_key(str(queue)), []).append(SaveTask(
            int(step), int(layer), int(enq), int(done), *_within(sync0, sync1, done), *_within(copy0, copy1, done)))
    return out
