"""The send thread's saves, for the replay's save times: one FIFO server, like the recv thread.

A load that waits on layer L's save waits for the send thread to finish it. The send thread serves
saves in enqueue order, so when the replayed forward issues saves earlier, a save queued behind a slow
one still completes when the send thread gets to it. Save times are therefore replayed as
``R'_j = max(A'_j, R'_(j-1)) + c_j`` per step: ``A'_j`` is the recorded issue time moved by the replayed
forward's shift at layer ``L_j``, ``c_j = complete_j - max(enqueue_j, complete_(j-1))`` the recorded
service time (with the dispatch gap). With the forward as recorded this gives the recorded times back.
Input: the ``kvtrace.send.task`` spans (docs/schema.md).
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


def process_key(queue: str) -> str:
    """The part of a queue id naming the process and ranks (the thread name dropped): recv and send
    queues of one worker share it."""
    return queue.rsplit("/", 1)[0]


def saves_from_duckdb(con: Any) -> dict[str, list[SaveTask]]:
    """Recorded saves per process key, in enqueue order. Empty when the traces hold no send tasks."""
    try:
        rows = con.execute(
            "SELECT attrs['kvtrace.queue'], CAST(attrs['kvtrace.step'] AS BIGINT), "
            "CAST(attrs['kvtrace.layer_id'] AS BIGINT), CAST(attrs['kvtrace.ts.enqueue'] AS BIGINT), "
            "CAST(attrs['kvtrace.ts.complete'] AS BIGINT) FROM spans WHERE name = 'kvtrace.send.task' "
            "AND attrs['kvtrace.ts.complete'] IS NOT NULL AND attrs['kvtrace.ts.enqueue'] IS NOT NULL "
            "ORDER BY 1, 4").fetchall()
    except Exception:  # no spans view (a tasks-only input): saves stay as recorded on the recv side
        return {}
    out: dict[str, list[SaveTask]] = {}
    for queue, step, layer, enq, done in rows:
        if queue is None or step is None or layer is None:
            continue
        out.setdefault(process_key(str(queue)), []).append(SaveTask(int(step), int(layer), int(enq), int(done)))
    return out
