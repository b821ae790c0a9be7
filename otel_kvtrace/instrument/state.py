"""Per-worker and per-queue state the wrappers share.

Each counter has exactly one writing thread (the forward thread enqueues, the recv thread dequeues and
completes), so reading them from other threads needs no lock: a reader may see a value one update
stale, never a torn one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from otel_kvtrace.record.model import QueueInfo, TaskRecord


@dataclass(slots=True)
class WorkerState:
    """Forward-side context of one KVPoolWorker: the step counter and the layer being waited for."""

    step: int = 0
    driven: bool = False  # True once start_load_kv is instrumented and has run
    attached: bool = False  # the worker's transfer threads are attached to this state
    forward_layer: int = -1  # current_layer during wait_for_layer_load
    # Records of the current step by layer, so the forward's consumer wait finds its task.
    step_records: dict[int, TaskRecord] = field(default_factory=dict)
    # Without start_load_kv (e.g. a bare recv thread), a repeated layer id starts a new step.
    seen_layers: set[int] = field(default_factory=set)


@dataclass(slots=True)
class QueueState:
    """One recv (or send) thread's queue: identity, counters, the task it is running now."""

    info: QueueInfo
    worker: WorkerState
    is_send: bool = False
    final_layer_id: int = -1
    thread_ident: int = 0  # set at the first _handle_request on the thread
    enqueued: int = 0  # written by the producer (forward) thread only
    dequeued: int = 0  # written by the consumer (recv) thread only
    completed: int = 0  # written by the consumer (recv) thread only
    gates_seen: int = 0
    untraced: int = 0  # tasks that reached _handle_request without a record (queued before tracing)
    current: TaskRecord | None = None
    # Send tasks are plain lists (no attribute to hang a record on): match them by FIFO order.
    send_fifo: deque[tuple[int, TaskRecord]] = field(default_factory=deque)  # (id(task list), record)
    consumer_tracking: bool = False
    # The thread's H2D stagger is a no-op (h2d_stagger_us <= 0, no slot waiter between it and the copy):
    # its zero-length h2d_stagger stage is written by the batch_copy wrapper, not by a wrapper of its own.
    stagger_at_submit: bool = False
    # The thread's class runs compiled probes (instrument/rewrite.py): no per-stage wrappers or proxies,
    # no thread binding; the stamps are statements of its _handle_request.
    compiled: bool = False
    # Objects replaced on the instance, for exact restore: (owner, attribute or index, original).
    undo: list[tuple[Any, Any, Any]] = field(default_factory=list)
