"""Records -> spans: the one place that maps a ``TaskRecord`` to the spans of ``docs/schema.md``.

Spans are written straight as OTLP/JSON text (lowerCamelCase keys, hex ids, int64 as decimal strings:
the shape the Collector's file exporter writes). Measured in ``bench/export.py`` (``docs/export.md``):
formatting text is the cheapest way to produce spans in Python, and, unlike building ``dict``s or
protobuf messages, it creates almost no garbage-collector-tracked objects, so exporting does not
drive the host process into extra GC passes. The file sink joins the text into lines; ``build()``
parses it back (``orjson``) into dicts for the protobuf encoder of the OTLP network sinks and for tests.

Runs on the exporter thread only, never on the hot path.
"""

from __future__ import annotations

import hashlib
import operator
import traceback
from collections.abc import Iterable
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii as _quote
from typing import Any

import orjson

from otel_kvtrace.record.model import (
    stage_triples,
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
    CONSUMER_RELEASE_NAMES,
    QueueInfo,
    ShippedError,
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


# ---- OTLP/JSON text fragments ---------------------------------------------------------------------
# An int attribute is  _int_key(key) + str(value) + _INT_END ; keys are constants, so prefixes are too.
_INT_END = '"}}'


def _int_key(key: str) -> str:
    return f'{{"key":{_quote(key)},"value":{{"intValue":"'


def _str_attr_text(key: str, value: str) -> str:
    return f'{{"key":{_quote(key)},"value":{{"stringValue":{_quote(value)}}}}}'


def _bool_attr_text(key: str, value: bool) -> str:
    return f'{{"key":{_quote(key)},"value":{{"boolValue":{"true" if value else "false"}}}}}'


_K_CORR = '{"key":"kvtrace.correlation_id","value":{"stringValue":'
_K_SEQ = _int_key("kvtrace.seq")
_K_STEP = _int_key("kvtrace.step")
_K_LAYER = _int_key("kvtrace.layer_id")
_K_NUM_BLOCKS = _int_key("kvtrace.num_blocks")
_K_BYTES = _int_key("kvtrace.bytes")
_K_SRC = _int_key("kvtrace.wait_for_save_layer")
_K_GATE = _int_key("kvtrace.gate_id")
_K_QDEPTH = _int_key("kvtrace.queue_depth_at_enqueue")
_K_INFLIGHT = _int_key("kvtrace.inflight_at_enqueue")
_K_TS_ENQ = _int_key("kvtrace.ts.enqueue")
_K_TS_DEQ = _int_key("kvtrace.ts.dequeue")
_K_TS_READY = _int_key("kvtrace.ts.ready")
_K_TS_READY_LO = _int_key("kvtrace.ts.ready_lo")
_K_TS_COMPLETE = _int_key("kvtrace.ts.complete")
_K_SRC_LAYER = _int_key("kvtrace.src_layer")
_K_CALLS = _int_key("kvtrace.calls")
_K_RESULT = _int_key("kvtrace.result")
_K_DEP_EXACT = tuple(_int_key(f"kvtrace.ts.dep.{name}") for name in DEP_NAMES)
_K_DEP_LO = tuple(_int_key(f"kvtrace.ts.dep.{name}_lo") for name in DEP_NAMES)
_K_DEP_HI = tuple(_int_key(f"kvtrace.ts.dep.{name}_hi") for name in DEP_NAMES)
_K_GROUPS = '{"key":"kvtrace.group_ids","value":{"arrayValue":{"values":['
_K_REQS = '{"key":"kvtrace.request_ids","value":{"arrayValue":{"values":['
_ARRAY_END = "]}}}"
_OUTCOME_TEXT = tuple(_str_attr_text("kvtrace.outcome", name) for name in OUTCOME_NAMES)
_PRECISION_EXACT = _str_attr_text("kvtrace.ready_precision", "exact")
_PRECISION_BOUNDED = _str_attr_text("kvtrace.ready_precision", "bounded")
_FINAL_TEXT = (_bool_attr_text("kvtrace.final_layer", False), _bool_attr_text("kvtrace.final_layer", True))
_THREAD_FORWARD = _str_attr_text("kvtrace.thread", "forward")
_CONSUMER_MISSING_TEXT = tuple(_str_attr_text("kvtrace.consumer_wait_missing", n) for n in CONSUMER_RELEASE_NAMES)
# Child span: f'{head}{span_id}{_CHILD_NAME}{name}{_TIMES}{start}{_END_TIME}{end}{_ATTRS}{attrs}{_CLOSE}';
_CHILD_NAME = '","name":"'
_TIMES = '","kind":1,"startTimeUnixNano":"'
_END_TIME = '","endTimeUnixNano":"'
_ATTRS = '","attributes":['
_CLOSE = '],"status":{}}'
_SPAN_NAMES = tuple(STAGE_SPAN_NAMES)


# ---- OTLP/JSON dict constructors (resource attributes and other run-time-typed values) -------------
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


def int_attr(key: str, value: int) -> dict[str, Any]:
    return {"key": key, "value": {"intValue": str(value)}}



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


def summarize_transfer_tasks(transfer_tasks: Any, max_reqs: int | None = None) -> TransferSummary:
    """Group ids, distinct request ids and block count of upstream ``LayerTransferTask`` objects.

    Defensive: upstream shapes differ between versions, fields may be missing, cleared or numpy
    arrays, so every read is a ``getattr`` with a default, no value is truth-tested, and a task that
    cannot be read contributes what was read before the error (never an exception).
    ``max_reqs``: stop naming request ids (``str()``) once that many distinct ones were found (the ring
    carries at most ``MAX_REQS`` and flags the cut); the block count stays exact.
    """
    group_ids: list[int] = []
    request_ids: dict[str, None] = {}
    num_blocks = 0
    if transfer_tasks is None:
        return TransferSummary(group_ids, [], 0)
    tasks: Iterable[Any] = transfer_tasks if isinstance(transfer_tasks, (list, tuple)) else (transfer_tasks,)
    for task in tasks:
        try:
            num_blocks += _summarize_one(task, group_ids, request_ids, max_reqs)
        except Exception:  # noqa: BLE001 - an unreadable upstream object must not stop tracing
            continue
    group_ids.sort()
    return TransferSummary(group_ids, list(request_ids), num_blocks)


def _as_int(value: Any) -> int | None:
    """``value`` as an int when it is an integer (including numpy integers), else ``None``."""
    if type(value) is int:
        return value
    if value is None or isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _summarize_one(task: Any, group_ids: list[int], request_ids: dict[str, None], max_reqs: int | None) -> int:
    group_id = getattr(task, "group_id", None)
    if type(group_id) is not int:  # the common case needs no helper call (this runs on recv threads)
        group_id = _as_int(group_id)
    if group_id is not None and group_id not in group_ids:
        group_ids.append(group_id)
    shared = getattr(task, "shared_block_data", None)
    shared_blocks = None
    if shared is not None:
        req_ids = getattr(shared, "req_ids", None)
        if req_ids is not None:
            for req_id in req_ids:
                if max_reqs is not None and len(request_ids) >= max_reqs:
                    break
                request_ids[str(req_id)] = None
        block_ids = getattr(shared, "block_ids_arr", None)
        if block_ids is not None:
            shared_blocks = len(block_ids)
        if req_ids is not None and shared_blocks is not None:
            # The shared data names the task's requests and blocks (upstream builds it from the same
            # requests as every layer's block ranges: kv_transfer.py LayerBatchBuilder.build_shared), so
            # the summary depends on it alone and ``RingWriter.write_task`` can reuse it across the step's layers.
            return shared_blocks
    range_blocks = 0
    block_ranges = getattr(task, "block_ranges", None)
    if block_ranges is not None:
        naming = True
        for block_range in block_ranges:
            if naming:
                req_id = getattr(getattr(block_range, "request", None), "req_id", None)
                if req_id is not None:
                    request_ids[str(req_id)] = None
                    naming = max_reqs is None or len(request_ids) < max_reqs
            start = getattr(block_range, "start_block", None)
            end = getattr(block_range, "end_block", None)
            if type(start) is not int or type(end) is not int:
                start, end = _as_int(start), _as_int(end)
            if start is not None and end is not None and end > start:
                range_blocks += end - start
    return shared_blocks if shared_blocks is not None else range_blocks


@dataclass(slots=True)
class _QueueConstants:
    """Per-queue text, computed once per ``QueueInfo`` object."""

    queue: QueueInfo
    text: str  # the path and queue attributes (root)
    child_text: tuple[str, str]  # per task kind: kvtrace.path + kvtrace.task, on every child span


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
            path = _str_attr_text("kvtrace.path", queue.path)
            text = f"{path},{_str_attr_text('kvtrace.queue', queue.queue_id)}"
            child = tuple(f"{path},{_str_attr_text('kvtrace.task', kind)}" for kind in ("recv", "send"))
            cached = _QueueConstants(queue, text, child)  # type: ignore[arg-type]
            self._queues[id(queue)] = cached
        return cached

    def _queue_text(self, queue: QueueInfo) -> str:
        return self._queue_constants(queue).text

    def build(self, record: TaskRecord) -> list[JsonSpan]:
        """The spans of one task record as OTLP/JSON dicts (root first), per ``docs/schema.md``."""
        return orjson.loads(f"[{self.build_json(record)}]")

    def build_json(self, record: TaskRecord) -> str:
        """The spans of one task record as comma-separated OTLP/JSON span objects (root first).

        Deterministic: the same record always yields the same ids, names, times and attributes.
        Raises ``ValueError`` on a record without ``queue`` (a recorder bug, not a data condition).
        """
        queue = record.queue
        if queue is None:
            raise ValueError("TaskRecord.queue is None: the recorder must set the queue identity")
        offset = self._offset
        corr = correlation_id(queue, record.kind, record.step, record.layer_id)
        trace_id, root_id_bytes = trace_ids_for(corr)
        root_id = root_id_bytes.hex()
        child_ids = child_span_ids(corr)
        # Every child carries its task's path and kind, so span metrics can split by them.
        child_attrs = self._queue_constants(queue).child_text[1 if record.kind == _KIND_SEND else 0]
        head = f'{{"traceId":"{trace_id.hex()}","spanId":"'
        child_parent = f'","parentSpanId":"{root_id}'

        # -- merge repeated stages: first start, last end, number of calls -----------------------
        starts = [0] * _NUM_STAGES
        ends = [0] * _NUM_STAGES
        calls = [0] * _NUM_STAGES
        for stage, start, end in stage_triples(record.stages):
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
        parts: list[str] = [""]  # slot 0: the root, filled in last
        if t_enq != NO_TIME and t_deq != NO_TIME:
            end = t_deq if t_deq > t_enq else t_enq
            lo, hi = t_enq, end
            parts.append(
                f"{head}{child_ids[_QUEUE_WAIT_IDX]}{child_parent}{_CHILD_NAME}{QUEUE_WAIT_SPAN}"
                f"{_TIMES}{t_enq + offset}{_END_TIME}{end + offset}"
                f"{_ATTRS}{child_attrs},{_K_QDEPTH}{record.queue_depth_at_enqueue}{_INT_END}{_CLOSE}"
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
            attrs = ""
            links = ""
            if stage in (_SAVE_CPU_WAIT, _SAVE_NPU_SYNC):
                if src is not None:
                    attrs = f"{_K_SRC_LAYER}{src}{_INT_END}"
                if stage == _SAVE_CPU_WAIT:
                    producer = producer_save_ids(record)
                    if producer is not None:
                        links = f',"links":[{{"traceId":"{producer[0].hex()}","spanId":"{producer[1].hex()}"}}]'
            elif stage in (_GATE_COND_WAIT, _GATE_NPU_SYNC):
                if gate is not None:
                    attrs = f"{_K_GATE}{gate}{_INT_END}"
            elif stage == _BACKEND_SUBMIT:
                attrs = f"{_K_BYTES}{record.nbytes}{_INT_END},{_K_RESULT}{record.backend_result}{_INT_END}"
            elif stage == _CONSUMER_WAIT:
                attrs = _THREAD_FORWARD
            if stage == _META_BUILD or n > 1:
                calls_text = f"{_K_CALLS}{n}{_INT_END}"
                attrs = f"{attrs},{calls_text}" if attrs else calls_text
            attrs = f"{child_attrs},{attrs}" if attrs else child_attrs
            text = (
                f"{head}{child_ids[stage + 1]}{child_parent}{_CHILD_NAME}{_SPAN_NAMES[stage]}{_TIMES}{start + offset}"
                f"{_END_TIME}{end + offset}{_ATTRS}{attrs}{_CLOSE}"
            )
            if links:
                text = f"{text[:-1]}{links}}}"
            parts.append(text)
        if t_ret != NO_TIME and t_done != NO_TIME:
            end = t_done if t_done > t_ret else t_ret
            if lo is None or t_ret < lo:
                lo = t_ret
            if hi is None or end > hi:
                hi = end
            parts.append(
                f"{head}{child_ids[_COMPLETION_IDX]}{child_parent}{_CHILD_NAME}{COMPLETION_SPAN}"
                f"{_TIMES}{t_ret + offset}{_END_TIME}{end + offset}{_ATTRS}{child_attrs}{_CLOSE}"
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

        tt = record.transfer_tasks
        summary = tt if isinstance(tt, TransferSummary) else summarize_transfer_tasks(tt)
        groups = ",".join([f'{{"intValue":"{g}"}}' for g in summary.group_ids])
        reqs = ",".join([f'{{"stringValue":{_quote(r)}}}' for r in summary.request_ids])
        attrs = (
            f"{_K_CORR}{_quote(corr)}}}}},{self._queue_text(queue)},"
            f"{_K_SEQ}{record.seq}{_INT_END},{_K_STEP}{record.step}{_INT_END},{_K_LAYER}{record.layer_id}{_INT_END},"
            f"{_FINAL_TEXT[bool(record.final_layer)]},{_K_GROUPS}{groups}{_ARRAY_END},{_K_REQS}{reqs}{_ARRAY_END},"
            f"{_K_NUM_BLOCKS}{summary.num_blocks}{_INT_END},{_K_BYTES}{record.nbytes}{_INT_END},"
        )
        if src is not None:
            attrs = f"{attrs}{_K_SRC}{src}{_INT_END},"
        if gate is not None:
            attrs = f"{attrs}{_K_GATE}{gate}{_INT_END},"
        attrs = (
            f"{attrs}{_K_QDEPTH}{record.queue_depth_at_enqueue}{_INT_END},"
            f"{_K_INFLIGHT}{record.inflight_at_enqueue}{_INT_END},{_OUTCOME_TEXT[record.outcome]}"
        )
        if t_enq != NO_TIME:
            attrs = f"{attrs},{_K_TS_ENQ}{t_enq + offset}{_INT_END}"
        if t_deq != NO_TIME:
            attrs = f"{attrs},{_K_TS_DEQ}{t_deq + offset}{_INT_END}"
        attrs = f"{attrs},{_ready_and_deps_text(record, offset)}"
        if t_done != NO_TIME:
            attrs = f"{attrs},{_K_TS_COMPLETE}{t_done + offset}{_INT_END}"
        if record.consumer_release:
            attrs = f"{attrs},{_CONSUMER_MISSING_TEXT[record.consumer_release]}"

        name = SEND_ROOT_SPAN if record.kind == _KIND_SEND else RECV_ROOT_SPAN
        tail = _CLOSE
        if record.outcome == _OUTCOME_ERROR:
            event_time = (t_done if t_done != NO_TIME else root_end) + offset
            tail = _error_tail(record.error, event_time)
        parts[0] = (
            f"{head}{root_id}{_CHILD_NAME}{name}{_TIMES}{root_start + offset}{_END_TIME}{root_end + offset}"
            f"{_ATTRS}{attrs}{tail}"
        )
        return ",".join(parts)


def build_task_spans(record: TaskRecord, anchor: ClockAnchor) -> list[JsonSpan]:
    """One-off convenience: ``SpanBuilder(anchor).build(record)``."""
    return SpanBuilder(anchor).build(record)


def _error_tail(error: BaseException | None, event_time: int) -> str:
    """Closing of the root span of a failed task: status ERROR and, when the exception was kept, an
    ``exception`` event (OTel semantic conventions)."""
    if error is None:
        return '],"status":{"code":2,"message":"task raised"}}'
    if isinstance(error, ShippedError):  # formatted in the serving process, decoded by the agent
        type_name, message, stack = error.type_name, error.message, error.stack
    else:
        type_name = type(error).__qualname__
        message = str(error)
        stack = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    status_message = f"{type_name}: {message}" if message else type_name
    return (
        f'],"status":{{"code":{STATUS_CODE_ERROR},"message":{_quote(status_message)}}},'
        f'"events":[{{"timeUnixNano":"{event_time}","name":"exception","attributes":['
        f'{_str_attr_text("exception.type", type_name)},{_str_attr_text("exception.message", message)},'
        f'{_str_attr_text("exception.stacktrace", stack)}]}}]}}'
    )


def _ready_and_deps_text(record: TaskRecord, offset: int) -> str:
    """``ts.dep.*`` (exact, or ``_lo``/``_hi`` bounds), ``ts.ready``, ``ts.ready_lo``, ``ready_precision``.

    A dependency the task needs but whose time was never observed (both ends ``NO_TIME``) is left out.
    """
    out: list[str] = []
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
            out.append(f"{_K_DEP_EXACT[dep]}{lo + offset}{_INT_END}")
        else:
            bounded = True
            if lo != NO_TIME:
                out.append(f"{_K_DEP_LO[dep]}{lo + offset}{_INT_END}")
            if hi != NO_TIME:
                out.append(f"{_K_DEP_HI[dep]}{hi + offset}{_INT_END}")
        upper = hi if hi != NO_TIME else lo
        lower = lo if lo != NO_TIME else hi
        if upper > ready_hi:
            ready_hi = upper
        if lower > ready_lo:
            ready_lo = lower
    if ready_hi != NO_TIME:
        out.append(f"{_K_TS_READY}{ready_hi + offset}{_INT_END}")
        if bounded:
            out.append(f"{_K_TS_READY_LO}{ready_lo + offset}{_INT_END}")
    out.append(_PRECISION_BOUNDED if bounded else _PRECISION_EXACT)
    return ",".join(out)
