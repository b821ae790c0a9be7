"""Stamp buffer bounds and drops; span export through the OTLP JSON codec; OTel metrics via the SDK."""

from __future__ import annotations

from pathlib import Path

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from otel_kvtrace.asynccheck import model as m
from otel_kvtrace.asynccheck.assemble import StepAssembler
from otel_kvtrace.asynccheck.recorder import Stamp, StampBuffer, StampKind
from otel_kvtrace.asynccheck.replica import ReplicaConfig, run_replica
from otel_kvtrace.export.otlp_json import json_line_to_request


def test_full_generation_drops_and_counts() -> None:
    buffer = StampBuffer(capacity=4, clock=iter(range(100)).__next__)
    for _ in range(6):
        buffer.stamp(StampKind.SCHED_BEGIN)
    assert [s.t for s in buffer.drain(settle_s=0)] == [0, 1, 2, 3]
    assert buffer.dropped == 2
    buffer.stamp(StampKind.SCHED_END)  # a fresh generation after the drain
    assert [s.kind for s in buffer.drain(settle_s=0)] == [StampKind.SCHED_END]


def test_missing_output_ready_falls_back_to_engine_observed() -> None:
    stamps = [Stamp(StampKind(k), t, 0, 0) for k, t in [(1, 0), (2, 2), (3, 2), (4, 3), (6, 10), (7, 11)]]
    (step,) = StepAssembler().feed(stamps)
    assert (step.done, step.done_precision) == (10, m.DONE_ENGINE_OBSERVED)


def test_output_ready_after_update_is_not_taken() -> None:
    kinds_times = [(1, 0), (2, 2), (3, 2), (4, 3), (6, 10), (7, 11), (5, 20)]
    (step,) = StepAssembler().feed([Stamp(StampKind(k), t, 0, 0) for k, t in kinds_times])
    assert step.done_precision == m.DONE_ENGINE_OBSERVED


def test_incomplete_steps_wait_for_their_update() -> None:
    assembler = StepAssembler()
    first = [Stamp(StampKind(k), t, 0, 0) for k, t in [(1, 0), (2, 2), (3, 2), (4, 3), (5, 9)]]
    assert assembler.feed(first) == []
    (step,) = assembler.feed([Stamp(StampKind.UPDATE_BEGIN, 10, 0, 0), Stamp(StampKind.UPDATE_END, 11, 0, 0)])
    # get_output returned on the engine thread (a = 0): max(ready, engine asks), only an upper bound
    assert (step.done, step.done_precision) == (9, m.DONE_ENGINE_POLL)


def _one_step(extra: list[tuple[int, int, int, int]]) -> object:
    base = [(1, 0, 0, 0), (2, 2, 0, 0), (3, 2, 0, 0), (4, 3, 0, 0), (6, 10, 0, 0), (7, 11, 0, 0)]
    (step,) = StepAssembler().feed([Stamp(StampKind(k), t, a, b) for k, t, a, b in base + extra])
    return step


def test_output_thread_get_output_is_device_ready() -> None:
    step = _one_step([(5, 8, 1, 0)])
    assert (step.done, step.done_precision) == (8, m.DONE_DEVICE_READY)


def test_watched_copy_event_beats_the_engines_late_poll() -> None:
    # watcher: registered at 3, last seen not ready at 5, ready at 6; the engine asked only at 9
    step = _one_step([(5, 9, 0, 0), (10, 6, 5, 3)])
    assert (step.done, step.done_precision, step.done_bound_ns) == (6, m.DONE_DEVICE_EVENT, 1)


def test_watched_ready_time_is_the_middle_of_the_watchers_bracket() -> None:
    # last query false at 4, first true at 8: the event completed in between; the first true is late by
    # the poll interval and the wake-up, the midpoint is off by at most half the bracket
    step = _one_step([(5, 9, 0, 0), (10, 8, 4, 3)])
    assert (step.done, step.done_precision, step.done_bound_ns) == (6, m.DONE_DEVICE_EVENT, 4)


def test_engine_blocked_in_get_output_returns_at_the_ready_time() -> None:
    # the engine blocked in synchronize before the watcher looked: its return (7) is the tighter bound
    step = _one_step([(5, 7, 0, 0), (10, 8, 6, 3)])
    assert (step.done, step.done_precision, step.done_bound_ns) == (7, m.DONE_DEVICE_EVENT, 1)


def test_ready_registered_before_the_launch_belongs_to_no_step() -> None:
    step = _one_step([(10, 1, 0, -5)])
    assert step.done_precision == m.DONE_ENGINE_OBSERVED


def test_trace_file_round_trips_and_metrics_reach_the_sdk(tmp_path: Path) -> None:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    path = run_replica(ReplicaConfig(mode="async", num_steps=6), out_dir=tmp_path, meter_provider=provider)
    assert path.parent == tmp_path and path.name == "kvtrace-async-replica-async.jsonl"
    names: list[str] = []
    for line in path.read_bytes().splitlines():
        req = json_line_to_request(line)
        for rs in req.resource_spans:
            res = {kv.key: kv.value for kv in rs.resource.attributes}
            assert res["kvtrace.source"].string_value == "replica"
            assert [ss.scope.name for ss in rs.scope_spans] == ["otel_kvtrace"]
            for ss in rs.scope_spans:
                names += [sp.name for sp in ss.spans]
    assert names.count(m.STEP_SPAN) == 6
    for name in (m.BATCH_SCHEDULE, m.MODEL_EXECUTE, m.EXECUTE_DONE, m.UPDATE_OUTPUT):
        assert names.count(name) == 6
    assert names.count(m.COMMUNICATION) == 6 * 4
    data = reader.get_metrics_data()
    metrics = {mt.name: mt for rm in data.resource_metrics for sm in rm.scope_metrics for mt in sm.metrics}
    dispatches = metrics[m.METRIC_DISPATCH_COUNT].data.data_points[0].value
    depth = metrics[m.METRIC_QUEUE_DEPTH].data.data_points[0]
    assert dispatches == 6
    assert (depth.count, depth.min, depth.max) == (6, 1, 2)


def test_stamps_of_never_completed_steps_stay_bounded() -> None:
    from otel_kvtrace.asynccheck.assemble import MAX_PENDING

    assembler = StepAssembler()  # like a worker process: only output-ready stamps, no engine loop
    assert assembler.feed(Stamp(StampKind.DONE, t, 0, 0) for t in range(MAX_PENDING + 100)) == []
    assert len(assembler._q[StampKind.DONE]) == MAX_PENDING


class _RefusingSink:
    """A destination that refuses every batch (an endpoint rejecting requests)."""

    def __init__(self) -> None:
        self.spans = 0

    def export(self, span_texts: list[str], dropped: int) -> bool:
        self.spans += sum(text.count('"traceId"') for text in span_texts)
        return False

    def shutdown(self, timeout_s: float | None = None) -> None:
        return None


def test_engine_steps_get_the_shared_exporters_accounting(tmp_path: Path) -> None:
    from otel_kvtrace.asynccheck.export import AsyncTracer, default_resource

    buffer = StampBuffer(capacity=64)
    sink = _RefusingSink()
    tracer = AsyncTracer(path=tmp_path / "unused.jsonl", buffer=buffer, sink=sink,
                         resource=default_resource(run_id="acc", source="replica", label="acc"))
    for n in range(3):  # three complete steps: schedule, launch, update
        for kind, t in [(1, 0), (2, 2), (3, 2), (4, 3), (6, 10), (7, 11)]:
            buffer.put(kind, 100 * n + t)
    tracer.shutdown(timeout_s=5)
    stats = tracer.exporter.stats()
    assert sink.spans == 3 * 5  # root + schedule, launch, done, update per step
    assert tracer.failed_batches == 1
    assert (stats.recorded, stats.delivered, stats.dropped, stats.pending) == (3, 0, 3, 0) and stats.balanced
    assert not (tmp_path / "unused.jsonl").exists()
