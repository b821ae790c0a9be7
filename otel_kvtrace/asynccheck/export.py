"""Assembled engine steps -> OTel spans (SDK ``ReadableSpan``) -> OTLP JSON lines, plus OTel metrics.

Runs off the hot path: ``AsyncTracer.flush()`` drains the stamp buffer, assembles steps, builds one
trace per step (root ``kvtrace.async.step`` with ``batch_schedule``, ``model_execute``, ``execute_done``,
``update_output``, ``compute``, ``communication`` children), appends one OTLP/JSON line per flush under
``./kvtrace-data/async/`` and feeds the ``async.dispatch_count`` counter and ``async.queue_depth``
histogram. A background daemon thread flushes periodically when started.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from multiprocessing import util as mp_util
from pathlib import Path
from typing import Any

import orjson
from opentelemetry import metrics
from opentelemetry.instrumentation.utils import suppress_instrumentation
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, TraceFlags

from otel_kvtrace import config
from otel_kvtrace.asynccheck import model as m
from otel_kvtrace.asynccheck.assemble import AssembledStep, OutputReady, StepAssembler, WorkerCall
from otel_kvtrace.asynccheck.recorder import StampBuffer
from otel_kvtrace.export.otlp_json import request_to_json_line
from otel_kvtrace.export.sinks import SpanSink, safe_run_id
from otel_kvtrace.export.worker import build_resource
from otel_kvtrace.record.recorder import ClockAnchor

logger = logging.getLogger("otel_kvtrace")

DEFAULT_DIR = config.DEFAULT_ASYNC_DIR
SCOPE = InstrumentationScope("otel_kvtrace")
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)


def _weak_call(obj: Any, method: str) -> Callable[[], None]:
    ref = weakref.WeakMethod(getattr(obj, method))

    def call() -> None:
        bound = ref()
        if bound is not None:
            try:
                bound()
            except Exception:  # noqa: BLE001 - exporting must never take the host down
                logger.exception("otel-kvtrace: async trace %s failed", method)

    return call


def register_at_fork(tracer: AsyncTracer) -> None:
    """``os.register_at_fork`` for the tracer (weakly: a dropped tracer is not kept alive by it)."""
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_weak_call(tracer, "after_fork_in_child"))


def async_trace_path(directory: str | os.PathLike[str], run_id: str, pid: int) -> Path:
    """``{directory}/kvtrace-async-{run_id}-{pid}.jsonl``, the run id made safe for a file name (a run id
    like ``../../x`` cannot leave ``directory``)."""
    return Path(directory) / f"kvtrace-async-{safe_run_id(run_id)}-{pid}.jsonl"


def default_resource(*, run_id: str, source: str, label: str, extra: Mapping[str, Any] | None = None) -> Resource:
    """Resource of an async trace file: the KV exporter's (``export.build_resource``: service name,
    ``OTEL_RESOURCE_ATTRIBUTES``, pid, host) plus the source and label (see docs/async_check.md)."""
    attrs: dict[str, Any] = {"kvtrace.run_id": run_id, "kvtrace.source": source, "kvtrace.cfg.label": label,
                             "process.parent_pid": os.getppid()}  # ties a worker process to its engine (DP)
    attrs.update(extra or {})
    return Resource(build_resource(attrs))


def _ids(key: str) -> tuple[int, int]:
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:16], "big"), int.from_bytes(digest[16:24], "big")


def _child_id(key: str, name: str, index: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{key}/{name}/{index}".encode()).digest()[:8], "big") or 1


def build_step_spans(
    step: AssembledStep, *, anchor: ClockAnchor, resource: Resource, lane: str, dropped: int = 0,
    outputs_dropped: int = 0,
) -> list[ReadableSpan]:
    """The spans of one engine step: a root and one child per phase (device intervals when known)."""
    key = f"{lane}/s{step.step}"
    trace_id, root_id = _ids(key)
    epoch = anchor.to_epoch
    root_ctx = SpanContext(trace_id, root_id, is_remote=False, trace_flags=_SAMPLED)
    common = {m.ATTR_STEP: step.step}
    phases: list[tuple[str, int, int, dict[str, Any]]] = [
        (m.BATCH_SCHEDULE, *step.schedule, {m.ATTR_BATCH_QUEUE: step.batch_queue}),
        (
            m.MODEL_EXECUTE,
            *step.launch,
            {m.ATTR_QUEUE_DEPTH: step.queue_depth, m.ATTR_DISPATCH_COUNT: step.dispatch_count},
        ),
        (m.EXECUTE_DONE, step.launch[1], max(step.launch[1], step.done),
         {m.ATTR_DONE_PRECISION: step.done_precision, m.ATTR_DONE_BOUND_NS: step.done_bound_ns}),
        (m.UPDATE_OUTPUT, *step.update, {}),
    ]
    phases += [(m.COMPUTE, s, e, {}) for s, e in step.compute]
    phases += [(m.COMMUNICATION, s, e, {}) for s, e in step.comm]
    start = min(p[1] for p in phases)
    end = max(p[2] for p in phases)
    root_attrs = {
        **common,
        m.ATTR_BATCH_QUEUE: step.batch_queue,
        m.ATTR_QUEUE_DEPTH: step.queue_depth,
        m.ATTR_DONE_PRECISION: step.done_precision,
        "kvtrace.exporter.dropped": dropped,
        m.ATTR_OUTPUTS_DROPPED: outputs_dropped,
    }
    spans = [_span(m.STEP_SPAN, root_ctx, None, resource, root_attrs, epoch(start), epoch(end))]
    for index, (name, s, e, attrs) in enumerate(phases):
        ctx = SpanContext(trace_id, _child_id(key, name, index), is_remote=False, trace_flags=_SAMPLED)
        spans.append(_span(name, ctx, root_ctx, resource, {**common, **attrs}, epoch(s), epoch(e)))
    return spans


def build_output_span(output: OutputReady, *, anchor: ClockAnchor, resource: Resource, lane: str,
                      outputs_dropped: int = 0) -> ReadableSpan:
    """One ``output_ready`` root span: [output created, output ready] in a worker process."""
    trace_id, span_id = _ids(f"{lane}/o{output.seq}")
    ctx = SpanContext(trace_id, span_id, is_remote=False, trace_flags=_SAMPLED)
    attrs = {m.ATTR_OUTPUT_SEQ: output.seq, m.ATTR_DONE_PRECISION: output.done_precision,
             m.ATTR_DONE_BOUND_NS: output.done_bound_ns, m.ATTR_OUTPUTS_DROPPED: outputs_dropped}
    return _span(m.OUTPUT_READY, ctx, None, resource, attrs, anchor.to_epoch(output.created),
                 anchor.to_epoch(output.done))


def build_worker_call_span(call: WorkerCall, *, anchor: ClockAnchor, resource: Resource, lane: str) -> ReadableSpan:
    """One ``worker_launch`` root span: a worker process's ``execute_model`` / ``sample_tokens`` call."""
    trace_id, span_id = _ids(f"{lane}/w{call.seq}")
    ctx = SpanContext(trace_id, span_id, is_remote=False, trace_flags=_SAMPLED)
    attrs = {m.ATTR_WORKER_CALL: call.call, m.ATTR_CALL_SEQ: call.seq}
    return _span(m.WORKER_LAUNCH, ctx, None, resource, attrs, anchor.to_epoch(call.start), anchor.to_epoch(call.end))


def _span(
    name: str,
    ctx: SpanContext,
    parent: SpanContext | None,
    resource: Resource,
    attrs: dict[str, Any],
    start: int,
    end: int,
) -> ReadableSpan:
    return ReadableSpan(
        name=name,
        context=ctx,
        parent=parent,
        resource=resource,
        attributes=attrs,
        kind=SpanKind.INTERNAL,
        start_time=start,
        end_time=end,
        instrumentation_scope=SCOPE,
    )


class AsyncTracer:
    """Owns the stamp buffer of one process and turns it into trace lines and metrics."""

    def __init__(
        self,
        *,
        path: Path,
        resource: Resource,
        buffer: StampBuffer | None = None,
        anchor: ClockAnchor | None = None,
        meter_provider: metrics.MeterProvider | None = None,
        path_for_pid: Callable[[int], Path] | None = None,
        sink: SpanSink | None = None,
    ) -> None:
        self.buffer = buffer if buffer is not None else StampBuffer()
        self.anchor = anchor if anchor is not None else ClockAnchor.take(self.buffer.clock)
        self.path = path
        self.resource = resource
        self.lane = f"{resource.attributes.get('kvtrace.run_id', 'run')}/pid{resource.attributes.get('process.pid', 0)}"
        self._path_for_pid = path_for_pid
        self.sink = sink  # an OTLP sink of the shared exporter (``export.create_sink``), else the file
        self.failed_batches = 0
        self._assembler = StepAssembler()
        self._lock = threading.Lock()  # flushes only: the hot path never takes it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._interval_s = 2.0
        self._fork_hooks = False
        self._shut = False
        self.steps_written = 0
        meter = (meter_provider or metrics.get_meter_provider()).get_meter("otel_kvtrace")
        self._dispatch_counter = meter.create_counter(
            m.METRIC_DISPATCH_COUNT, unit="{dispatch}", description="model_execute dispatches of the engine loop"
        )
        self._depth_histogram = meter.create_histogram(
            m.METRIC_QUEUE_DEPTH, unit="{batch}", description="batches in flight at each dispatch (incl. this one)"
        )

    def flush(self, settle_s: float = 0.001) -> int:
        """Export every completed step (and, in a process without an engine loop, every output)."""
        with self._lock:
            steps = self._assembler.feed(self.buffer.drain(settle_s))
            outputs = self._assembler.orphan_outputs()
            calls = self._assembler.worker_calls()
            if not steps and not outputs and not calls:
                return 0
            self._write(steps, outputs, calls)
            self.steps_written += len(steps)
            return len(steps) + len(outputs) + len(calls)

    def _write(self, steps: Sequence[AssembledStep], outputs: Sequence[OutputReady] = (),
               calls: Sequence[WorkerCall] = ()) -> None:
        dropped, lost = self.buffer.dropped, self.buffer.outputs_dropped
        spans: list[ReadableSpan] = [build_output_span(o, anchor=self.anchor, resource=self.resource, lane=self.lane,
                                                       outputs_dropped=lost) for o in outputs]
        spans += [build_worker_call_span(c, anchor=self.anchor, resource=self.resource, lane=self.lane) for c in calls]
        for step in steps:
            spans += build_step_spans(step, anchor=self.anchor, resource=self.resource, lane=self.lane, dropped=dropped,
                                      outputs_dropped=lost)
            self._dispatch_counter.add(1)
            self._depth_histogram.record(step.queue_depth)
        line = request_to_json_line(encode_spans(spans))
        if self.sink is not None:
            self._send(line, dropped)
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("ab") as fh:
            fh.write(line)

    def _send(self, line: bytes, dropped: int) -> None:
        """To the shared OTLP sink (it adds the resource, and retries, compresses, ... as configured)."""
        texts = [orjson.dumps(span).decode()
                 for rs in orjson.loads(line)["resourceSpans"] for ss in rs["scopeSpans"] for span in ss["spans"]]
        ok = False
        try:
            with suppress_instrumentation():
                ok = bool(self.sink.export(texts, dropped))
        except Exception as exc:  # noqa: BLE001 - a sink error loses this batch only
            logger.debug("otel-kvtrace: async trace export failed: %r", exc)
        if not ok:
            self.failed_batches += 1

    def start(self, interval_s: float = 2.0) -> None:
        """Flush every ``interval_s`` from a daemon thread until ``shutdown``; follow forks.

        A forked child (vLLM's engine-core process when the plugin ran in the parent) inherits the patches
        and this buffer but not the thread: ``after_fork_in_child`` starts a fresh one writing the child's
        own file. multiprocessing children leave through ``os._exit``, past ``atexit``, so the final flush
        is also registered as a multiprocessing finalizer (run by ``Process._bootstrap`` before it exits).
        """
        if self._thread is not None:
            return
        self._interval_s = interval_s
        self._thread = threading.Thread(target=self._loop, args=(interval_s,), name="kvtrace-async-export", daemon=True)
        self._thread.start()
        if not self._fork_hooks:
            self._fork_hooks = True
            register_at_fork(self)
            # a multiprocessing child clears inherited finalizers first, then runs the after-fork hooks
            mp_util.register_after_fork(self, AsyncTracer._register_exit_flush)
        self._register_exit_flush()

    def _register_exit_flush(self) -> None:
        mp_util.Finalize(None, _weak_call(self, "shutdown"), exitpriority=10)

    def after_fork_in_child(self) -> None:
        """The parent's stamps and half-assembled steps are not this process's: start clean."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        self.buffer.drain(settle_s=0)
        self._assembler = StepAssembler()
        pid = os.getpid()
        attrs = dict(self.resource.attributes)
        attrs["process.pid"] = pid
        attrs["process.parent_pid"] = os.getppid()
        self.resource = Resource(attrs)
        self.lane = f"{attrs.get('kvtrace.run_id', 'run')}/pid{pid}"
        if self._path_for_pid is not None:
            self.path = self._path_for_pid(pid)
        self.steps_written = 0
        if not self._shut:
            self.start(self._interval_s)

    def _loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - exporting must never take the host down
                logger.exception("otel-kvtrace: async trace export failed")

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the flusher and write what is left. Idempotent."""
        self._shut = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        self.flush()
        if self.sink is not None:
            try:
                self.sink.shutdown()
            except Exception as exc:  # noqa: BLE001
                logger.debug("otel-kvtrace: async sink shutdown failed: %r", exc)
