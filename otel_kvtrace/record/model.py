"""Task records: what the hot path writes, what the exporter reads.

A record holds raw clock stamps (``perf_counter_ns`` on real threads, virtual ns in the simulator) and
references to upstream objects; nothing is formatted until export. The span/attribute contract these
fields map to is ``docs/schema.md``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from enum import IntEnum
from collections.abc import Iterator
from typing import Any

NO_TIME = -1
"""Sentinel for "did not happen" in int stamp fields (cheaper than ``None`` checks on export)."""


class Stage(IntEnum):
    """Child-span stages recorded explicitly. ``queue_wait`` and ``completion`` are derived."""

    SAVE_CPU_WAIT = 0
    SAVE_NPU_SYNC = 1
    GATE_COND_WAIT = 2
    GATE_NPU_SYNC = 3
    META_BUILD = 4
    H2D_STAGGER = 5
    SLOT_RELEASE_WAIT = 6
    BACKEND_SUBMIT = 7
    CONSUMER_WAIT = 8


STAGE_SPAN_NAMES: tuple[str, ...] = (
    "save_cpu_wait",
    "save_npu_sync",
    "gate_cond_wait",
    "gate_npu_sync",
    "meta_build",
    "h2d_stagger",
    "slot_release_wait",
    "backend_submit",
    "consumer_wait",
)
QUEUE_WAIT_SPAN = "queue_wait"
CONSUMER_WAIT_SPAN = "consumer_wait"
COMPLETION_SPAN = "completion"
RECV_ROOT_SPAN = "kvtrace.recv.task"
SEND_ROOT_SPAN = "kvtrace.send.task"
ALL_CHILD_SPAN_NAMES: tuple[str, ...] = (QUEUE_WAIT_SPAN, *STAGE_SPAN_NAMES, COMPLETION_SPAN)


class Dep(IntEnum):
    """Dependencies whose satisfied time is recorded (producer side)."""

    SAVE_CPU = 0
    SAVE_NPU = 1
    GATE_RECORD = 2
    GATE_NPU = 3
    SLOT_RELEASE = 4


DEP_NAMES: tuple[str, ...] = ("save_cpu", "save_npu", "gate_record", "gate_npu", "slot_release")
NUM_DEPS = len(DEP_NAMES)
_BLANK_DEPS = (NO_TIME,) * (2 * NUM_DEPS)


class Outcome(IntEnum):
    OK = 0
    EMPTY = 1
    ERROR = 2


OUTCOME_NAMES: tuple[str, ...] = ("ok", "empty", "error")


CONSUMER_RELEASE_NAMES: tuple[str, ...] = ("", "step_boundary", "shutdown", "producer_died", "agent_bound")
"""``kvtrace.consumer_wait_missing`` values: the record was awaited by the forward's consumer wait but
released without it at the next step boundary, at shutdown/exit, when the serving process died, or when the
exporter agent's bound on tasks awaiting their consumer wait was reached."""


class ShippedError(Exception):
    """A task's exception as the exporter agent received it (type name, message, formatted stack)."""

    def __init__(self, type_name: str, message: str, stack: str) -> None:
        super().__init__(message)
        self.type_name = type_name
        self.message = message
        self.stack = stack

    def __str__(self) -> str:
        return self.message


class BackendResultError(RuntimeError):
    """A backend copy returned a non-zero result code without raising (vLLM-Ascend 0.23 logs and goes on).

    The message is built only when read (export), never on the recording thread.
    """

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code

    def __str__(self) -> str:
        return f"backend copy returned result code {self.code}"


class TaskKind(IntEnum):
    RECV = 0
    SEND = 1


@dataclass(slots=True)
class QueueInfo:
    """Identity of one FIFO (one recv or send thread of one worker process). Shared by its records."""

    run_id: str
    path: str  # "gva" | "key"
    thread_name: str
    pid: int
    dp: int = 0
    pp: int = 0
    tp: int = 0
    pcp: int = 0
    dcp: int = 0
    num_layers: int = 0

    @property
    def queue_id(self) -> str:
        # The ranks make it unique across a deployment even when every rank shares OTEL_KVTRACE_RUN_ID
        # and identical containers reuse the same pids.
        return f"{self.run_id}/{self.rank_label}/pid{self.pid}/{self.thread_name}"

    @property
    def rank_label(self) -> str:
        return f"dp{self.dp}.pp{self.pp}.tp{self.tp}.pcp{self.pcp}.dcp{self.dcp}"


_RECV = int(TaskKind.RECV)
_OK = int(Outcome.OK)


@dataclass(slots=True)
class TaskRecord:
    """One recv (or send) task: identity, stamps, dependency times, outcome.

    Stamps are ints in the recorder's clock (``NO_TIME`` when absent). Stages are a flat list of
    ``stage, start, end`` triples in the order they ran (``rec.stages.extend((stage, start, end))``; read
    them with ``stage_triples``): no tuple outlives the call, so recording creates no garbage for the
    cyclic GC to scan. Each dependency is a ``[lo, hi]`` pair in
    ``deps`` (``lo == hi`` means measured exactly; ``NO_TIME`` means the task has no such dependency
    or it was never observed).
    """

    queue: QueueInfo | None = None
    kind: int = _RECV  # plain ints, not the IntEnum members: cheaper to reset and to pack
    seq: int = 0
    step: int = 0
    layer_id: int = 0
    final_layer: bool = False
    wait_for_save_layer: int | None = None
    gate_id: int | None = None
    queue_depth_at_enqueue: int = 0
    inflight_at_enqueue: int = 0
    t_enqueue: int = NO_TIME
    t_dequeue: int = NO_TIME
    t_backend_return: int = NO_TIME
    t_complete: int = NO_TIME
    stages: list[int] = field(default_factory=list)
    deps: list[int] = field(default_factory=lambda: [NO_TIME] * (2 * NUM_DEPS))
    has_dep: int = 0  # bitmask of Dep the task depends on
    outcome: int = _OK
    error: BaseException | None = None
    nbytes: int = 0
    backend_result: int = 0
    # Raw references, described at export time (never formatted on the hot path): the task's
    # ``LayerTransferTask`` list (a copy: upstream clears its own), or its one task as is.
    transfer_tasks: Any = None
    # Device-time marks ``(Dep, timing_event)`` resolved off the hot path (``Recorder.drain``).
    npu_marks: list[tuple[int, Any]] = field(default_factory=list)
    # Completion hand-off between the recv thread and the forward's consumer wait.
    holds: list[int] = field(default_factory=list)
    # Why the forward's consumer wait is absent although it was awaited (``CONSUMER_RELEASE_NAMES``).
    consumer_release: int = 0

    def reset(self) -> None:
        """Return to a blank state so the record can be reused from the pool."""
        self.queue = None
        self.kind = _RECV
        self.seq = self.step = self.layer_id = 0
        self.final_layer = False
        self.wait_for_save_layer = self.gate_id = None
        self.queue_depth_at_enqueue = self.inflight_at_enqueue = 0
        self.t_enqueue = self.t_dequeue = self.t_backend_return = self.t_complete = NO_TIME
        self.stages.clear()
        self.deps[:] = _BLANK_DEPS
        self.has_dep = 0
        self.outcome = _OK
        self.error = None
        self.nbytes = self.backend_result = 0
        self.transfer_tasks = None
        self.npu_marks.clear()
        self.holds.clear()
        self.consumer_release = 0

    # -- dependency helpers (cheap: list index writes) -------------------------------------------
    def need(self, dep: int) -> None:
        self.has_dep |= 1 << dep

    def dep_exact(self, dep: int, t: int) -> None:
        self.has_dep |= 1 << dep
        self.deps[2 * dep] = t
        self.deps[2 * dep + 1] = t

    def dep_bounds(self, dep: int, lo: int, hi: int) -> None:
        self.has_dep |= 1 << dep
        self.deps[2 * dep] = lo
        self.deps[2 * dep + 1] = hi

    def dep_lo(self, dep: int) -> int:
        return self.deps[2 * dep]

    def dep_hi(self, dep: int) -> int:
        return self.deps[2 * dep + 1]


def stage_triples(stages: list[int]) -> Iterator[tuple[int, int, int]]:
    """``(stage, start, end)`` for each stage of a record's flat ``stages`` list."""
    it = iter(stages)
    return zip(it, it, it)


def correlation_id(queue: QueueInfo, kind: int, step: int, layer_id: int) -> str:
    """Stable, deployment-unique id of a task (see docs/schema.md)."""
    what = queue.path if kind == TaskKind.RECV else f"{queue.path}-save"
    return f"{queue.run_id}/{queue.rank_label}/{what}/s{step}/l{layer_id}"


def trace_ids_for(correlation: str) -> tuple[bytes, bytes]:
    """Trace id (16 bytes) and root span id (8 bytes) derived deterministically from a correlation id."""
    digest = hashlib.sha256(correlation.encode()).digest()
    trace_id = digest[:16]
    span_id = digest[16:24]
    if not any(trace_id):  # all-zero ids are invalid in OTLP
        trace_id = b"\x00" * 15 + b"\x01"
    if not any(span_id):
        span_id = b"\x00" * 7 + b"\x01"
    return trace_id, span_id
