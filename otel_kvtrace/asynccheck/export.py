"""Assembled engine steps -> OTLP/JSON spans through the shared exporter and sinks, plus OTel metrics.

Runs off the hot path. ``StepSource`` is the shared recorder (``record.recorder.Recorder``) fed with
assembled engine steps (root ``kvtrace.async.step`` with ``batch_schedule``, ``model_execute``,
``execute_done``, ``update_output``, ``compute``, ``communication`` children) and worker outputs
(``output_ready``) instead of task records; the shared ``export.worker.BackgroundExporter`` drains it.
Thread, at-fork restart, exit drain, failure accounting and sinks are the KV traces' own: one OTLP/JSON
line per batch in ``./kvtrace-data/async/kvtrace-async-*.jsonl`` (``JsonLinesFileSink``), or the OTLP
sink with its spool and retries. Steps feed the
``async.dispatch_count`` counter and ``async.queue_depth`` histogram.
"""

from __future__ import annotations

import hashlib
import logging
import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson
from opentelemetry import metrics
from opentelemetry.sdk.resources import Resource

from otel_kvtrace import config
from otel_kvtrace.asynccheck import model as m
from otel_kvtrace.asynccheck.assemble import AssembledStep, OutputReady, StepAssembler, WorkerCall
from otel_kvtrace.asynccheck.recorder import StampBuffer
from otel_kvtrace.export.encode import json_span
from otel_kvtrace.export.sinks import JsonLinesFileSink, SpanSink, safe_run_id
from otel_kvtrace.export.spans import JsonSpan
from otel_kvtrace.export.worker import BackgroundExporter, build_resource
from otel_kvtrace.record.model import trace_ids_for
from otel_kvtrace.record.recorder import ClockAnchor, Recorder

logger = logging.getLogger("otel_kvtrace")

DEFAULT_DIR = config.DEFAULT_ASYNC_DIR
INTERVAL_S = 2.0
"""How often the exporter thread drains the stamp buffer."""


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
    """Trace and root span id of ``key``, derived as a KV task's are from its correlation id."""
    trace_id, span_id = trace_ids_for(key)
    return int.from_bytes(trace_id, "big"), int.from_bytes(span_id, "big")


def _child_id(key: str, name: str, index: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{key}/{name}/{index}".encode()).digest()[:8], "big") or 1


def build_step_spans(
    step: AssembledStep, *, anchor: ClockAnchor, lane: str, dropped: int = 0, outputs_dropped: int = 0,
) -> list[JsonSpan]:
    """The spans of one engine step: a root and one child per phase (device intervals when known)."""
    key = f"{lane}/s{step.step}"
    trace_id, root_id = _ids(key)
    epoch = anchor.to_epoch
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
    spans = [json_span(trace_id, root_id, None, m.STEP_SPAN, epoch(start), epoch(end), root_attrs)]
    for index, (name, s, e, attrs) in enumerate(phases):
        spans.append(json_span(trace_id, _child_id(key, name, index), root_id, name, epoch(s), epoch(e),
                               {**common, **attrs}))
    return spans


def build_output_span(output: OutputReady, *, anchor: ClockAnchor, lane: str, outputs_dropped: int = 0) -> JsonSpan:
    """One ``output_ready`` root span: [output created, output ready] in a worker process."""
    trace_id, span_id = _ids(f"{lane}/o{output.seq}")
    attrs = {m.ATTR_OUTPUT_SEQ: output.seq, m.ATTR_DONE_PRECISION: output.done_precision,
             m.ATTR_DONE_BOUND_NS: output.done_bound_ns, m.ATTR_OUTPUTS_DROPPED: outputs_dropped}
    return json_span(trace_id, span_id, None, m.OUTPUT_READY, anchor.to_epoch(output.created),
                     anchor.to_epoch(output.done), attrs)


def build_worker_call_span(call: WorkerCall, *, anchor: ClockAnchor, lane: str) -> JsonSpan:
    """One ``worker_launch`` root span: a worker process's ``execute_model`` / ``sample_tokens`` call."""
    trace_id, span_id = _ids(f"{lane}/w{call.seq}")
    attrs = {m.ATTR_WORKER_CALL: call.call, m.ATTR_CALL_SEQ: call.seq}
    return json_span(trace_id, span_id, None, m.WORKER_LAUNCH, anchor.to_epoch(call.start),
                     anchor.to_epoch(call.end), attrs)

class StepSource(Recorder):
    """The shared recorder (``record.recorder.Recorder``: bounded hand-off, drop and submit counts) fed with
    assembled steps and outputs instead of task records, for the shared exporter to drain.

    ``collect`` (the exporter calls it once per export cycle, on its thread) drains the stamp buffer
    into the assembler and submits what is complete; ``build_json`` turns one into span text. Stamps
    still in the buffer are not records yet; stamps a full buffer lost stay ``StampBuffer.dropped``, on
    every step span.
    """

    def __init__(self, buffer: StampBuffer, anchor: ClockAnchor, lane: str,
                 meter_provider: metrics.MeterProvider | None = None) -> None:
        # a cycle's steps always fit: each takes at least six stamps of one buffer generation
        super().__init__(capacity=buffer.capacity, clock=buffer.clock, anchor=anchor)
        self.buffer = buffer
        self.lane = lane
        self.settle_s = 0.001
        self.steps_written = 0
        self._assembler = StepAssembler()
        meter = (meter_provider or metrics.get_meter_provider()).get_meter("otel_kvtrace")
        self._dispatch_counter = meter.create_counter(
            m.METRIC_DISPATCH_COUNT, unit="{dispatch}", description="model_execute dispatches of the engine loop"
        )
        self._depth_histogram = meter.create_histogram(
            m.METRIC_QUEUE_DEPTH, unit="{batch}", description="batches in flight at each dispatch (incl. this one)"
        )

    def collect(self) -> None:
        """Submit what the buffer completes: steps, a worker's launch calls and (in a process with no
        engine loop) outputs."""
        try:
            steps = self._assembler.feed(self.buffer.drain(self.settle_s))
            items: list[AssembledStep | OutputReady | WorkerCall] = [
                *self._assembler.orphan_outputs(), *self._assembler.worker_calls(), *steps]
        except Exception:  # noqa: BLE001 - an assembler bug costs these stamps, never the exporter
            logger.exception("otel-kvtrace: engine-loop stamps could not be assembled")
            return
        for item in items:
            self.submit(item)  # type: ignore[arg-type]

    def build_json(self, item: AssembledStep | OutputReady | WorkerCall) -> str:
        """One step's spans (or one output's or worker call's span) as OTLP/JSON text; a step also feeds
        the metrics."""
        lost = self.buffer.outputs_dropped
        if isinstance(item, OutputReady):
            return orjson.dumps(build_output_span(item, anchor=self.anchor, lane=self.lane,
                                                  outputs_dropped=lost)).decode()
        if isinstance(item, WorkerCall):
            return orjson.dumps(build_worker_call_span(item, anchor=self.anchor, lane=self.lane)).decode()
        spans = build_step_spans(item, anchor=self.anchor, lane=self.lane, dropped=self.buffer.dropped,
                                 outputs_dropped=lost)
        self._dispatch_counter.add(1)
        self._depth_histogram.record(item.queue_depth)
        self.steps_written += 1
        return ",".join(orjson.dumps(span).decode() for span in spans)

    def recycle(self, records: Sequence[Any]) -> None:  # type: ignore[override]
        """Steps are not pooled."""

    def after_fork_in_child(self, pid: int) -> None:
        """The parent's stamps, half-assembled and pending steps are not the child's."""
        self.buffer.drain(settle_s=0)
        self._assembler = StepAssembler()
        self.after_fork()  # the shared recorder's: pending steps and counts are the parent's
        self.lane = f"{self.lane.rsplit('/pid', 1)[0]}/pid{pid}"
        self.steps_written = 0


class AsyncTracer:
    """One process's stamp buffer, exported by the shared ``BackgroundExporter`` into ``sink`` (default:
    the OTLP/JSON lines file ``path``; after a fork, ``path_for_pid(child pid)``)."""

    def __init__(
        self,
        *,
        path: Path,
        resource: Resource | Mapping[str, Any],
        buffer: StampBuffer | None = None,
        anchor: ClockAnchor | None = None,
        meter_provider: metrics.MeterProvider | None = None,
        path_for_pid: Callable[[int], Path] | None = None,
        sink: SpanSink | None = None,
    ) -> None:
        self.buffer = buffer if buffer is not None else StampBuffer()
        self.anchor = anchor if anchor is not None else ClockAnchor.take(self.buffer.clock)
        attrs = dict(getattr(resource, "attributes", resource))
        self.resource = Resource(attrs)
        run_id = str(attrs.get("kvtrace.run_id", "run"))
        self.sink: SpanSink = sink if sink is not None else JsonLinesFileSink(
            Path(path).parent, run_id, attrs, path_for_pid=path_for_pid or (lambda pid: Path(path)))
        self.source = StepSource(self.buffer, self.anchor, f"{run_id}/pid{attrs.get('process.pid', 0)}",
                                 meter_provider)
        if hasattr(os, "register_at_fork"):  # before the exporter's own hook: the child starts clean
            ref = weakref.WeakMethod(self.after_fork_in_child)
            os.register_at_fork(after_in_child=lambda: (method := ref()) is not None and method())
        # thread, at-fork restart, exit drain (atexit and multiprocessing's os._exit), failure accounting;
        # its task-record counters stay off the application's meter (the KV exporter's own)
        self.exporter = BackgroundExporter(self.source, self.sink, interval_s=INTERVAL_S, start=False,
                                           build=self.source.build_json, meter_provider=metrics.NoOpMeterProvider())

    @property
    def path(self) -> Path:
        """The trace file of this process (the file sink's)."""
        return Path(getattr(self.sink, "path", ""))

    @property
    def failed_batches(self) -> int:
        return self.exporter.failed_batches

    @property
    def steps_written(self) -> int:
        return self.source.steps_written

    def flush(self, settle_s: float = 0.001) -> int:
        """Export every completed step (and, in a process without an engine loop, every output) now."""
        before = self.source.submitted
        self.source.settle_s = settle_s
        try:
            self.exporter.force_flush()
        finally:
            self.source.settle_s = 0.001
        return self.source.submitted - before

    def start(self, interval_s: float = INTERVAL_S) -> None:
        """Export every ``interval_s`` from the exporter's thread until ``shutdown``. A forked child (vLLM's
        engine-core process when the plugin ran in the parent) inherits the patches and this buffer; the
        exporter restarts its thread there, and the child writes its own file."""
        self.exporter.interval_s = interval_s
        self.exporter.start()

    def after_fork_in_child(self) -> None:
        """The parent's stamps are not this process's; its spans carry the child's pid."""
        pid = os.getpid()
        self.source.after_fork_in_child(pid)
        child = {"process.pid": pid, "process.parent_pid": os.getppid()}  # ties a worker to its engine (DP)
        self.resource = Resource({**self.resource.attributes, **child})
        update = getattr(self.sink, "update_resource", None)
        if update is not None:
            update(child)

    def shutdown(self, timeout_s: float | None = None) -> None:
        """Write what is left, stop the thread, close the sink. Idempotent."""
        self.exporter.shutdown(timeout_s)
