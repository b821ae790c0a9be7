"""Names and records shared by the async-scheduling check: span names, table rows, findings.

The span names and the table columns are documented in ``docs/async_check.md``; every importer maps its
format onto these canonical names so one analysis serves our own traces and msServiceProfiler captures.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# ---- canonical span names (our traces write them; importers map onto them) -------------------------
STEP_SPAN = "kvtrace.async.step"
BATCH_SCHEDULE = "batch_schedule"
MODEL_EXECUTE = "model_execute"
EXECUTE_DONE = "execute_done"
UPDATE_OUTPUT = "update_output"
COMMUNICATION = "communication"
COMPUTE = "compute"
FORWARD = "forward"
"""A device-synchronised forward window (MindIE sync mode, msServiceProfiler's vLLM hooks)."""

LAUNCH_API = "launch_api"
"""An MSPTI ``Api`` row (the host call that queued a kernel; joined to it by ``correlationId``)."""
FORWARD_UNKNOWN = "forward_unknown_kind"
"""Done precision of a ``forward.csv`` forward: device-synchronised (MindIE sync) or a host launch (async)."""
OUTPUT_READY = "output_ready"
"""Root span of a process that creates async outputs but runs no engine loop (a ``MultiprocExecutor``
worker): [output created, output ready]; joined to the engine's steps by time at analysis."""

WORKER_LAUNCH = "worker_launch"
"""Root span of a process without an engine loop: one ``execute_model`` / ``sample_tokens`` call of its
worker (``async.worker_call``); joined to the engine's steps by time at analysis: the device-side launch."""
WORKER_SPANS = frozenset({OUTPUT_READY, WORKER_LAUNCH})
"""Spans of a ``MultiprocExecutor`` worker process: no step number, the engine's run id."""

STEP_CHILD_SPANS: tuple[str, ...] = (
    OUTPUT_READY,
    WORKER_LAUNCH,
    BATCH_SCHEDULE,
    MODEL_EXECUTE,
    EXECUTE_DONE,
    UPDATE_OUTPUT,
    COMMUNICATION,
    COMPUTE,
)

# ---- span attributes ---------------------------------------------------------------------------------
ATTR_STEP = "async.step"
ATTR_BATCH_QUEUE = "async.batch_queue"
ATTR_QUEUE_DEPTH = "async.queue_depth"
ATTR_DISPATCH_COUNT = "async.dispatch_count"
ATTR_DONE_PRECISION = "async.done_precision"
ATTR_DONE_BOUND_NS = "async.done_bound_ns"
ATTR_OUTPUT_SEQ = "async.output_seq"
ATTR_WORKER_CALL = "async.worker_call"
ATTR_CALL_SEQ = "async.call_seq"
ATTR_MODE = "async.mode"
ATTR_OUTPUTS_DROPPED = "async.outputs_dropped"
"""Cumulative outputs the output-ready watcher did not watch (more than ``ready.MAX_PENDING`` in flight)."""

# ---- OTel metric names ---------------------------------------------------------------------------------
METRIC_DISPATCH_COUNT = "async.dispatch_count"
METRIC_QUEUE_DEPTH = "async.queue_depth"

# ---- done precision ----------------------------------------------------------------------------------
DONE_DEVICE_EVENT = "device_event"
"""The output's copy-ready event seen complete by the watcher (bracket width in ``async.done_bound_ns``)."""
DONE_DEVICE_READY = "device_ready"
"""``get_output`` returned on an output thread (it blocks until the device result is ready)."""
DONE_ENGINE_POLL = "engine_poll"
"""``get_output`` returned on the engine thread: max(device ready, engine asks), an upper bound."""
DONE_ENGINE_OBSERVED = "engine_observed"
"""Only the engine's use of the output is known (``update_from_output`` entry): an upper bound."""
DONE_WORKER_RETURN = "worker_return"
"""A ``MultiprocExecutor`` worker's ``sample_tokens`` returned a synchronous output (no async output: the
sync loop): it returns once the device result is on the host, before the engine sees it."""
DONE_UPPER_BOUNDS = frozenset({DONE_ENGINE_POLL, DONE_ENGINE_OBSERVED})
"""Precisions that bound the ready time by the engine's own poll (overlap over-, gap under-estimated)."""
DONE_SYNCED_FORWARD = "synced_forward"
DONE_KERNELS = "kernels"
DONE_FUTURE_CALLBACK = "future_done_callback"
"""msServiceProfiler's current vLLM hooks end ``modelExec`` in the Future's done-callback (output ready)."""

# ---- markers of the async path ----------------------------------------------------------------------
MARKER_BATCH_QUEUE = "vllm_batch_queue_step"
MARKER_MINDIE_ASYNC_FORWARD = "mindie_forward_async_attr"
MARKER_MINDIE_ASYNC_SPANS = "mindie_async_only_spans"
MARKER_ASYNC_METRICS = "async_queue_metrics"

MINDIE_ASYNC_ONLY_SPANS = frozenset(
    {"get_from_output_queue", "put_into_input_queue", "wait_to_postprocess", "synchronize_processing_stream"}
)

# ---- capture warnings ----------------------------------------------------------------------------------
WARN_NPU_SYNC_HOOKS = "npu_sync_hooks"
WARN_SCHEDULE_DOMAIN_MISSING = "schedule_domain_missing"
WARN_SCHEDULE_MISSING = "schedule_missing"
WARN_COMM_DOMAIN_NOT_HCCL = "communication_domain_not_hccl"
WARN_UNIT_GUESS = "unit_convention"
WARN_MULTI_PROCESS = "multi_process"
WARN_DROPPED = "recorder_dropped"
WARN_OUTPUTS_DROPPED = "outputs_dropped"
WARN_FORWARD_KIND_UNKNOWN = "forward_kind_unknown"
WARN_KERNELS_BY_TIME = "kernels_by_time"
WARN_SPAN_START_LOST = "span_start_lost"
WARN_PROCESS_JOINED = "process_joined"
"""A capture of several engine processes (DP): a process without schedule spans was given to one engine."""
WARN_PROCESS_LEFT_OUT = "process_left_out"
"""A run of several engine processes (DP): a worker process naming none of them as parent joined none."""


@dataclass(slots=True)
class SpanRow:
    """One span in canonical form (table ``async_spans``); times are epoch ns."""

    run: str
    file: str
    lane: str
    step: int | None
    name: str
    origin: str
    start_ns: int
    end_ns: int
    attrs: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class StepRow:
    """One engine step (table ``async_steps``); ``None`` where the capture has no such time."""

    run: str
    lane: str
    step: int
    schedule_start: int | None = None
    schedule_end: int | None = None
    launch_start: int | None = None
    launch_end: int | None = None
    device_start: int | None = None
    done: int | None = None
    update_start: int | None = None
    update_end: int | None = None
    worker_launch_start: int | None = None
    """``MultiprocExecutor``: the worker process's ``execute_model`` start (the launch onto the device)."""
    worker_launch_end: int | None = None
    """... and the end of its last call for the step (``execute_model`` or ``sample_tokens``)."""
    done_precision: str | None = None
    batch_queue: bool | None = None
    queue_depth: int | None = None
    batch_size: int | None = None
    batch_type: str | None = None
    """``Prefill``/``Decode``/``Mixed``/... from the schedule span (``batch_type``, or MindIE's ``batchType``)."""
    """Requests in the step's batch (msServiceProfiler ``batch_size`` / ``rid`` list of the schedule span)."""


@dataclass(slots=True)
class RequestRow:
    """One served request from msServiceProfiler's ``request.csv`` (table ``async_requests``)."""

    run: str
    file: str
    rid: str
    start_ns: int | None
    latency_ms: float | None
    ttft_ms: float | None
    queue_ms: float | None
    out_tokens: int | None


@dataclass(slots=True)
class ImportIssue:
    """A malformed row that was skipped (table ``async_import_errors``)."""

    run: str
    file: str
    line: int
    reason: str


@dataclass(slots=True)
class CaptureWarning:
    """Something about how a capture was made that limits what it can prove (table ``async_warnings``)."""

    run: str
    file: str
    kind: str
    message: str


@dataclass(slots=True)
class Marker:
    """Evidence that the async path ran (table ``async_markers``)."""

    run: str
    file: str
    marker: str
    count: int


@dataclass(slots=True)
class ImportResult:
    """Everything one importer produced for one file."""

    spans: list[SpanRow] = field(default_factory=list)
    issues: list[ImportIssue] = field(default_factory=list)
    warnings: list[CaptureWarning] = field(default_factory=list)
    markers: list[Marker] = field(default_factory=list)
    seen: set[str] = field(default_factory=set)
    """Raw span names and ``domain:<d>`` seen (for capture warnings)."""
    requests: list[RequestRow] = field(default_factory=list)

    def extend(self, other: ImportResult) -> None:
        self.spans.extend(other.spans)
        self.requests.extend(other.requests)
        self.issues.extend(other.issues)
        self.warnings.extend(other.warnings)
        self.markers.extend(other.markers)
        self.seen |= other.seen
