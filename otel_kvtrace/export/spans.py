"""Records -> spans: the one place that maps a ``TaskRecord`` to the spans of ``docs/schema.md``.

Spans are built straight into their OTLP/JSON form (``dict``s with lowerCamelCase keys, hex ids, int64
as decimal strings, the shape the Collector's file exporter writes). That is the cheapest Python form to
build (``bench/export.py``, ``docs/export.md``): the file sink only wraps and ``orjson``-dumps them, and
``export/encode.py`` converts them to protobuf for the OTLP network sinks.

Runs on the exporter thread only, never on the hot path.
"""

from __future__ import annotations

import hashlib
import traceback
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from otel_kvtrace.record.model import (
    ALL_CHILD_SPAN_NAMES,
    COMPLETION_SPAN,
    DEP_NAMES,
    NO_TIME,
    OUTCOME_NAMES,
    QUEUE_WAIT_SPAN,
    RECV_ROOT_SPAN,
    SEND_ROOT_SPAN,
    STAGE_SPAN_NAMES,
    Outcome,
    QueueInfo,
    Stage,
    TaskKind,
    TaskRecord,
    correlation_id,
    trace_ids_for,
)
from otel_kvtrace.record.recorder import ClockAnchor

JsonSpan = dict[str, Any]
"""One span in OTLP/JSON form (as in ``resourceSpans[].scopeSpans[].spans[]``)."""

SPAN_KIND_INTERNAL = 1
STATUS_CODE_ERROR = 2

_NUM_STAGES = len(STAGE_SPAN_NAMES)
_NUM_CHILDREN = len(ALL_CHILD_SPAN_NAMES)
_QUEUE_WAIT_IDX = 0
_COMPLETION_IDX = _NUM_CHILDREN - 1
_CHILD_ID_SALT = b"kvtrace-child/"
_ZERO_SPAN_ID = "0" * 16
# Plain ints: IntEnum attribute lookups cost ~0.1 us each, and this loop runs per stage per task.
_SAVE_CPU_WAIT = int(Stage.SAVE_CPU_WAIT)
_SAVE_NPU_SYNC = int(Stage.SAVE_NPU_SYNC)
_GATE_COND_WAIT = int(Stage.GATE_COND_WAIT)
_GATE_NPU_SYNC = int(Stage.GATE_NPU_SYNC)
_META_BUILD = int(Stage.META_BUILD)
_BACKEND_SUBMIT = int(Stage.BACKEND_SUBMIT)
_CONSUMER_WAIT = int(Stage.CONSUMER_WAIT)
_KIND_SEND = int(TaskKind.SEND)
_OUTCOME_ERROR = int(Outcome.ERROR)
_DEP_EXACT_KEYS = tuple(f"kvtrace.ts.dep.{name}" for name in DEP_NAMES)
_DEP_LO_KEYS = tuple(f"kvtrace.ts.dep.{name}_lo" for name in DEP_NAMES)
_DEP_HI_KEYS = tuple(f"kvtrace.ts.dep.{name}_hi" for name in DEP_NAMES)


# ---- OTLP/JSON attribute constructors (typed: the builder knows every attribute's type) -----------
def int_attr(key: str, value: int) -> dict[str, Any]:
    return {"key": key, "value": {"intValue": str(value)}}


def str_attr(key: str, value: str) -> dict[str, Any]:
    return {"key": key, "value": {"stringValue": value}}


def bool_attr(key: str, value: bool) -> dict[str, Any]:
    return {"key": key, "value": {"boolValue": value}}


def int_array_attr(key: str, values: Iterable[int]) -> dict[str, Any]:
    return {"key": key, "value": {"arrayValue": {"values": [{"intValue": str(v)} for v in values]}}}


def str_array_attr(key: str, values: Iterable[str]) -> dict[str, Any]:
    return {"key": key, "value": {"arrayValue": {"values": [{"stringValue": v} for v in values]}}}


def any_attr(key: str, value: Any) -> dict[str, Any]:
    """Attribute of a value whose type is known only at run time (resource attributes)."""
    return {"key": key, "value": any_value(value)}


def any_value(value: Any) -> dict[str, Any]:
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(int(value))}
    if isinstance(value, float):
        return {"doubleValue": value}
    if isinstance(value, (list, tuple)):
        return {"arrayValue": {"values": [any_value(v) for v in value]}}
    return {"stringValue": str(value)}


# Attributes whose value repeats: built once, shared (orjson only reads them).
_OUTCOME_ATTRS = tuple(str_attr("kvtrace.outcome", name) for name in OUTCOME_NAMES)
_PRECISION_EXACT = str_attr("kvtrace.ready_precision", "exact")
_PRECISION_BOUNDED = str_attr("kvtrace.ready_precision", "bounded")
_FINAL_ATTRS = (bool_attr("kvtrace.final_layer", False), bool_attr("kvtrace.final_layer", True))
_THREAD_FORWARD = str_attr("kvtrace.thread", "forward")
_EMPTY_STATUS: dict[str, Any] = {}


@dataclass(slots=True)
class TransferSummary:
    """What the exporter reads from the upstream ``LayerTransferTask`` references of a record."""

    group_ids: list[int]
    request_ids: list[str]
    num_blocks: int


def child_span_ids(correlation: str) -> list[str]:
    """Deterministic hex span ids of every possible child (index = position in ``ALL_CHILD_SPAN_NAMES``).

    One SHAKE-128 call per task (cheaper than one hash per child); all-zero ids are invalid in OTLP.
    """
    raw = hashlib.shake_128(_CHILD_ID_SALT + correlation.encode()).hexdigest(8 * _NUM_CHILDREN)
    ids = [raw[i : i + 16] for i in range(0, 16 * _NUM_CHILDREN, 16)]
    for i, span_id in enumerate(ids):
        if span_id == _ZERO_SPAN_ID:
            ids[i] = f"{i + 1:016x}"
    return ids


def producer_save_ids(record: TaskRecord) -> tuple[bytes, bytes] | None:
    """Trace id and root span id of the producer save task this recv task waited for, if any."""
    if record.wait_for_save_layer is None or record.queue is None:
        return None
    producer = correlation_id(record.queue, TaskKind.SEND, record.step, record.wait_for_save_layer)
    return trace_ids_for(producer)


def summarize_transfer_tasks(transfer_tasks: Any) -> TransferSummary:
    """Group ids, distinct request ids and block count of upstream ``LayerTransferTask`` objects.

    Defensive: upstream shapes differ between versions and fields may be missing or cleared, so every
    read is a ``getattr`` with a default and anything unreadable contributes nothing.
    """
    group_ids: list[int] = []
    request_ids: dict[str, None] = {}
    num_blocks = 0
    if transfer_tasks is None:
        return TransferSummary(group_ids, [], 0)
    tasks: Iterable[Any] = transfer_tasks if isinstance(transfer_tasks, (list, tuple)) else (transfer_tasks,)
    for task in tasks:
        group_id = getattr(task, "group_id", None)
        if isinstance(group_id, int) and group_id not in group_ids:
            group_ids.append(group_id)
        shared = getattr(task, "shared_block_data", None)
        task_blocks = None
        if shared is not None:
            for req_id in getattr(shared, "req_ids", None) or ():
                request_ids[str(req_id)] = None
            block_ids = getattr(shared, "block_ids_arr", None)
            if block_ids is not None:
                try:
                    task_blocks = len(block_ids)
                except TypeError:
                    task_blocks = None
        range_blocks = 0
        for block_range in getattr(task, "block_ranges", None) or ():
            request = getattr(block_range, "request", None)
            req_id = getattr(request, "req_id", None)
            if req_id is not None:
                request_ids[str(req_id)] = None
            start = getattr(block_range, "start_block", None)
            end = getattr(block_range, "end_block", None)
            if isinstance(start, int) and isinstance(end, int) and end > start:
                range_blocks += end - start
        num_blocks += task_blocks if task_blocks is not None else range_blocks
    group_ids.sort()
    return TransferSummary(group_ids, list(request_ids), num_blocks)




@dataclass(slots=True)
class _QueueConstants:
    """Per-queue attribute values, computed once per ``QueueInfo`` object."""

    queue: QueueInfo
    path_attr: dict[str, Any]
    queue_attr: dict[str, Any]


class SpanBuilder:
    """Builds the OTLP/JSON spans of task records, caching per-queue constants.

    One builder per exporter (not thread-safe; the exporter thread owns it).
    """

    def __init__(self, anchor: ClockAnchor) -> None:
        self.anchor = anchor
        self._offset = anchor.epoch_ns - anchor.clock_ns  # epoch = stamp + offset
        self._queues: dict[int, _QueueConstants] = {}

    def _queue_constants(self, queue: QueueInfo) -> _QueueConstants:
        cached = self._queues.get(id(queue))
        if cached is None or cached.queue is not queue:
            if len(self._queues) > 4096:  # queues are few; guard against a caller minting one per task
                self._queues.clear()
            cached = _QueueConstants(queue, str_attr("kvtrace.path", queue.path), str_attr("kvtrace.queue", queue.queue_id))
            self._queues[id(queue)] = cached
        return cached

    def build(self, record: TaskRecord) -> list[JsonSpan]:
        """The spans of one task record (root first), per ``docs/schema.md``.

        Deterministic: the same record always yields the same ids, names, times and attributes.
        Raises ``ValueError`` on a record without ``queue`` (a recorder bug, not a data condition).
        """
        queue = record.queue
        if queue is None:
            raise ValueError("TaskRecord.queue is None: the recorder must set the queue identity")
        offset = self._offset
        qc = self._queue_constants(queue)
        corr = correlation_id(queue, record.kind, record.step, record.layer_id)
        trace_id, root_id_bytes = trace_ids_for(corr)
        trace_hex = trace_id.hex()
        root_id = root_id_bytes.hex()
        child_ids = child_span_ids(corr)

        # -- merge repeated stages: first start, last end, number of calls -----------------------
        starts = [0] * _NUM_STAGES
        ends = [0] * _NUM_STAGES
        calls = [0] * _NUM_STAGES
        for stage, start, end in record.stages:
            if start == NO_TIME:
                continue
            if end < start:
                end = start
            if calls[stage]:
                if start < starts[stage]:
                    starts[stage] = start
                if end > ends[stage]:
                    ends[stage] = end
            else:
                starts[stage] = start
                ends[stage] = end
            calls[stage] += 1

        # -- children; track the earliest start and latest end for the root ----------------------
        t_enq = record.t_enqueue
        t_deq = record.t_dequeue
        t_ret = record.t_backend_return
        t_done = record.t_complete
        src = record.wait_for_save_layer
        gate = record.gate_id
        lo = hi = None  # clock stamps
        children: list[JsonSpan] = []
        if t_enq != NO_TIME and t_deq != NO_TIME:
            end = t_deq if t_deq > t_enq else t_enq
            lo, hi = t_enq, end
            children.append(
                {
                    "traceId": trace_hex,
                    "spanId": child_ids[_QUEUE_WAIT_IDX],
                    "parentSpanId": root_id,
                    "name": QUEUE_WAIT_SPAN,
                    "kind": SPAN_KIND_INTERNAL,
                    "startTimeUnixNano": str(t_enq + offset),
                    "endTimeUnixNano": str(end + offset),
                    "attributes": [int_attr("kvtrace.queue_depth_at_enqueue", record.queue_depth_at_enqueue)],
                    "status": _EMPTY_STATUS,
                }
            )
        for stage in range(_NUM_STAGES):
            n = calls[stage]
            if not n:
                continue
            start = starts[stage]
            end = ends[stage]
            if lo is None or start < lo:
                lo = start
            if hi is None or end > hi:
                hi = end
            attrs: list[dict[str, Any]] = []
            span: JsonSpan = {
                "traceId": trace_hex,
                "spanId": child_ids[stage + 1],
                "parentSpanId": root_id,
                "name": STAGE_SPAN_NAMES[stage],
                "kind": SPAN_KIND_INTERNAL,
                "startTimeUnixNano": str(start + offset),
                "endTimeUnixNano": str(end + offset),
                "attributes": attrs,
                "status": _EMPTY_STATUS,
            }
            if stage == _SAVE_CPU_WAIT or stage == _SAVE_NPU_SYNC:
                if src is not None:
                    attrs.append(int_attr("kvtrace.src_layer", src))
                if stage == _SAVE_CPU_WAIT:
                    producer = producer_save_ids(record)
                    if producer is not None:
                        span["links"] = [{"traceId": producer[0].hex(), "spanId": producer[1].hex()}]
            elif stage == _GATE_COND_WAIT or stage == _GATE_NPU_SYNC:
                if gate is not None:
                    attrs.append(int_attr("kvtrace.gate_id", gate))
            elif stage == _BACKEND_SUBMIT:
                attrs.append(int_attr("kvtrace.bytes", record.nbytes))
                attrs.append(int_attr("kvtrace.result", record.backend_result))
            elif stage == _CONSUMER_WAIT:
                attrs.append(_THREAD_FORWARD)
            if stage == _META_BUILD or n > 1:
                attrs.append(int_attr("kvtrace.calls", n))
            children.append(span)
        if t_ret != NO_TIME and t_done != NO_TIME:
            end = t_done if t_done > t_ret else t_ret
            if lo is None or t_ret < lo:
                lo = t_ret
            if hi is None or end > hi:
                hi = end
            children.append(
                {
                    "traceId": trace_hex,
                    "spanId": child_ids[_COMPLETION_IDX],
                    "parentSpanId": root_id,
                    "name": COMPLETION_SPAN,
                    "kind": SPAN_KIND_INTERNAL,
                    "startTimeUnixNano": str(t_ret + offset),
                    "endTimeUnixNano": str(end + offset),
                    "attributes": [],
                    "status": _EMPTY_STATUS,
                }
            )

        # -- root span: enqueue (or the earliest child) -> the latest child end or completion -------
        root_start = t_enq
        if root_start == NO_TIME or (lo is not None and lo < root_start):  # a stamp before enqueue: keep the tree valid
            root_start = lo if lo is not None else (t_done if t_done != NO_TIME else 0)
        root_end = hi if hi is not None else root_start
        if t_done != NO_TIME and t_done > root_end:
            root_end = t_done
        if root_end < root_start:
            root_end = root_start
        root_start += offset
        root_end += offset

        summary = summarize_transfer_tasks(record.transfer_tasks)
        attrs = [
            str_attr("kvtrace.correlation_id", corr),
            qc.path_attr,
            qc.queue_attr,
            int_attr("kvtrace.seq", record.seq),
            int_attr("kvtrace.step", record.step),
            int_attr("kvtrace.layer_id", record.layer_id),
            _FINAL_ATTRS[bool(record.final_layer)],
            int_array_attr("kvtrace.group_ids", summary.group_ids),
            str_array_attr("kvtrace.request_ids", summary.request_ids),
            int_attr("kvtrace.num_blocks", summary.num_blocks),
            int_attr("kvtrace.bytes", record.nbytes),
        ]
        if src is not None:
            attrs.append(int_attr("kvtrace.wait_for_save_layer", src))
        if gate is not None:
            attrs.append(int_attr("kvtrace.gate_id", gate))
        attrs.append(int_attr("kvtrace.queue_depth_at_enqueue", record.queue_depth_at_enqueue))
        attrs.append(int_attr("kvtrace.inflight_at_enqueue", record.inflight_at_enqueue))
        attrs.append(_OUTCOME_ATTRS[record.outcome])
        if t_enq != NO_TIME:
            attrs.append(int_attr("kvtrace.ts.enqueue", t_enq + offset))
        if t_deq != NO_TIME:
            attrs.append(int_attr("kvtrace.ts.dequeue", t_deq + offset))
        _append_ready_and_deps(attrs, record, offset)
        if t_done != NO_TIME:
            attrs.append(int_attr("kvtrace.ts.complete", t_done + offset))

        root: JsonSpan = {
            "traceId": trace_hex,
            "spanId": root_id,
            "name": SEND_ROOT_SPAN if record.kind == _KIND_SEND else RECV_ROOT_SPAN,
            "kind": SPAN_KIND_INTERNAL,
            "startTimeUnixNano": str(root_start),
            "endTimeUnixNano": str(root_end),
            "attributes": attrs,
            "status": _EMPTY_STATUS,
        }
        if record.outcome == _OUTCOME_ERROR:
            _mark_error(root, record.error, t_done + offset if t_done != NO_TIME else root_end)
        children.insert(0, root)
        return children


def build_task_spans(record: TaskRecord, anchor: ClockAnchor) -> list[JsonSpan]:
    """One-off convenience: ``SpanBuilder(anchor).build(record)``."""
    return SpanBuilder(anchor).build(record)


def _mark_error(root: JsonSpan, error: BaseException | None, event_time: int) -> None:
    """Status ERROR and, when the exception object was kept, an ``exception`` event (semconv)."""
    if error is None:
        root["status"] = {"code": STATUS_CODE_ERROR, "message": "task raised"}
        return
    type_name = type(error).__qualname__
    message = str(error)
    stack = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    root["status"] = {"code": STATUS_CODE_ERROR, "message": f"{type_name}: {message}" if message else type_name}
    root["events"] = [
        {
            "timeUnixNano": str(event_time),
            "name": "exception",
            "attributes": [
                str_attr("exception.type", type_name),
                str_attr("exception.message", message),
                str_attr("exception.stacktrace", stack),
            ],
        }
    ]


def _append_ready_and_deps(attrs: list[dict[str, Any]], record: TaskRecord, offset: int) -> None:
    """``ts.dep.*`` (exact, or ``_lo``/``_hi`` bounds), ``ts.ready``, ``ts.ready_lo``, ``ready_precision``.

    A dependency the task needs but whose time was never observed (both ends ``NO_TIME``) is left out.
    """
    ready_hi = ready_lo = record.t_enqueue
    bounded = False
    has_dep = record.has_dep
    deps = record.deps
    for dep in range(len(DEP_NAMES)):
        if not has_dep >> dep & 1:
            continue
        lo = deps[2 * dep]
        hi = deps[2 * dep + 1]
        if lo == NO_TIME and hi == NO_TIME:
            continue
        if lo == hi:
            attrs.append(int_attr(_DEP_EXACT_KEYS[dep], lo + offset))
        else:
            bounded = True
            if lo != NO_TIME:
                attrs.append(int_attr(_DEP_LO_KEYS[dep], lo + offset))
            if hi != NO_TIME:
                attrs.append(int_attr(_DEP_HI_KEYS[dep], hi + offset))
        upper = hi if hi != NO_TIME else lo
        lower = lo if lo != NO_TIME else hi
        if upper > ready_hi:
            ready_hi = upper
        if lower > ready_lo:
            ready_lo = lower
    if ready_hi != NO_TIME:
        attrs.append(int_attr("kvtrace.ts.ready", ready_hi + offset))
        if bounded:
            attrs.append(int_attr("kvtrace.ts.ready_lo", ready_lo + offset))
    attrs.append(_PRECISION_BOUNDED if bounded else _PRECISION_EXACT)
