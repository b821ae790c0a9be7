"""BackgroundExporter: never blocks recording threads, bounded memory, exact drop accounting, draining
shutdown, failure containment, file sink round-trip, configuration from the environment."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import orjson
import pytest
from export_records import fill_record
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from otel_kvtrace.export import (
    BackgroundExporter,
    JsonLinesFileSink,
    NullSink,
    OtlpGrpcSink,
    OtlpHttpSink,
    build_resource,
    create_exporter,
    create_sink,
    json_line_to_request,
    trace_file_path,
)
from otel_kvtrace.record.model import RECV_ROOT_SPAN
from otel_kvtrace.record.recorder import Recorder

RESOURCE = {"kvtrace.source": "replica", "kvtrace.run_id": "wtest", "service.name": "kvtrace"}


class GatedFileSink(JsonLinesFileSink):
    """A real file sink whose first export blocks until released: a stalled endpoint, deterministically."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory, "wtest", RESOURCE)
        self.entered = threading.Event()
        self.release = threading.Event()
        self.completed = 0

    def export(self, span_texts: Sequence[str], dropped: int) -> bool:
        if self.completed == 0:
            self.entered.set()
            self.release.wait(30)
        ok = super().export(span_texts, dropped)
        self.completed += 1
        return ok


def _submit(recorder: Recorder, n: int, start_seq: int = 0) -> None:
    for i in range(start_seq, start_seq + n):
        rec = recorder.new_record()
        fill_record(rec, seq=i, step=i // 8, layer_id=i % 8, t0=recorder.clock())
        recorder.submit(rec)


def _read_lines(path: Path) -> list[ExportTraceServiceRequest]:
    return [json_line_to_request(line) for line in path.read_bytes().splitlines()]


def _root_seqs(requests: list[ExportTraceServiceRequest]) -> list[int]:
    seqs = []
    for req in requests:
        for span in req.resource_spans[0].scope_spans[0].spans:
            if span.name == RECV_ROOT_SPAN:
                seqs.append(next(a.value.int_value for a in span.attributes if a.key == "kvtrace.seq"))
    return seqs


def _scope_dropped(req: ExportTraceServiceRequest) -> int:
    (attr,) = req.resource_spans[0].scope_spans[0].scope.attributes
    assert attr.key == "kvtrace.exporter.dropped"
    return attr.value.int_value


def test_stalled_export_never_blocks_recording(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    capacity, batch, attempts = 64, 16, 5_000
    recorder = Recorder(capacity=capacity)
    sink = GatedFileSink(tmp_path)
    reader = InMemoryMetricReader()
    exporter = BackgroundExporter(
        recorder,
        sink,
        interval_s=0.01,
        batch_size=batch,
        drop_log_interval_s=3600,
        meter_provider=MeterProvider([reader]),
        start=False,
    )
    _submit(recorder, batch)
    exporter.start()  # the first drain takes exactly one full batch
    assert sink.entered.wait(10), "exporter never picked up the first batch"

    # Export is now blocked inside the sink. A recording thread submits many more tasks.
    done = threading.Event()
    recording = threading.Thread(target=lambda: (_submit(recorder, attempts, start_seq=batch), done.set()))
    with caplog.at_level(logging.WARNING, logger="otel_kvtrace"):
        recording.start()
        recording.join(30)
        # Structural proof: every submit returned while the sink had not completed a single export.
        assert done.is_set() and not recording.is_alive()
        assert sink.completed == 0 and not sink.release.is_set()
        assert recorder.pending == capacity  # bounded: the hand-off holds at most `capacity` records
        assert recorder.dropped == attempts - capacity  # every record that did not fit was counted

        sink.release.set()
        assert exporter.shutdown(timeout_s=30)
    kept = batch + capacity
    assert exporter.exported_tasks == kept
    requests = _read_lines(sink.path)
    seqs = _root_seqs(requests)
    assert sorted(seqs) == list(range(batch)) + list(range(batch, batch + capacity))  # the first ones fit
    assert _scope_dropped(requests[-1]) == attempts - capacity
    # one warning line for the whole episode (interval 1 h), naming the count
    warnings = [r.getMessage() for r in caplog.records if r.name == "otel_kvtrace" and r.levelno == logging.WARNING]
    summary = [w for w in warnings if "export summary" in w]
    warnings = [w for w in warnings if w not in summary]
    assert len(warnings) == 1 and str(attempts - capacity) in warnings[0]
    assert len(summary) == 1 and f"dropped={attempts - capacity} " in summary[0] and "(balanced)" in summary[0]
    # the metric counter saw the same number
    points = [
        p.value
        for rm in reader.get_metrics_data().resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == "kvtrace.exporter.dropped_records"
        for p in m.data.data_points
    ]
    assert points == [attempts - capacity]


def test_shutdown_drains_every_submitted_record(tmp_path: Path) -> None:
    recorder = Recorder(capacity=4096)
    sink = JsonLinesFileSink(tmp_path, "wtest", RESOURCE)
    exporter = BackgroundExporter(recorder, sink, interval_s=3600, batch_size=100)  # never wakes by itself
    _submit(recorder, 1_000)
    assert recorder.pending == 1_000
    assert exporter.shutdown(timeout_s=30)
    assert recorder.pending == 0
    requests = _read_lines(sink.path)
    assert len(requests) == 10
    assert sorted(_root_seqs(requests)) == list(range(1_000))
    assert exporter.shutdown() is True  # idempotent
    assert exporter._thread is not None and not exporter._thread.is_alive()


def test_force_flush_exports_pending_now(tmp_path: Path) -> None:
    recorder = Recorder()
    sink = JsonLinesFileSink(tmp_path, "wtest", RESOURCE)
    exporter = BackgroundExporter(recorder, sink, interval_s=3600)
    _submit(recorder, 5)
    assert exporter.force_flush(timeout_s=10)
    assert sorted(_root_seqs(_read_lines(sink.path))) == list(range(5))
    exporter.shutdown()


def test_worker_thread_is_named_daemon(tmp_path: Path) -> None:
    exporter = BackgroundExporter(Recorder(), NullSink(), interval_s=0.01)
    thread = exporter._thread
    assert thread is not None and thread.name == "kvtrace-exporter" and thread.daemon
    exporter.shutdown()
    assert not thread.is_alive()


def test_records_are_recycled_into_the_pool(tmp_path: Path) -> None:
    recorder = Recorder(capacity=32)
    exporter = BackgroundExporter(recorder, NullSink(), interval_s=3600)
    _submit(recorder, 10)
    exporter.force_flush()
    pooled = recorder.new_record()
    assert pooled.queue is None and pooled.stages == [] and pooled.transfer_tasks is None  # reset, reused
    exporter.shutdown()


def test_build_error_disables_tracing_once_and_never_raises(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    recorder = Recorder()
    sink = JsonLinesFileSink(tmp_path, "wtest", RESOURCE)
    exporter = BackgroundExporter(recorder, sink, interval_s=3600)
    _submit(recorder, 3)
    bad = recorder.new_record()
    bad.queue = None  # a recorder bug: the builder cannot name the task
    recorder.submit(bad)
    with caplog.at_level(logging.ERROR, logger="otel_kvtrace"):
        exporter.force_flush()
        _submit(recorder, 2)
        exporter.force_flush()
        exporter.shutdown()
    assert recorder.enabled is False
    assert "building spans failed" in (recorder.disabled_reason or "")
    errors = [r for r in caplog.records if r.name == "otel_kvtrace" and r.levelno >= logging.ERROR]
    assert len(errors) == 1
    assert recorder.dropped == 6  # the failing batch (4) and everything after (2)
    assert not sink.path.exists()  # nothing half-built was written


def test_sink_exception_loses_only_that_batch(tmp_path: Path) -> None:
    class FlakySink(JsonLinesFileSink):
        calls = 0

        def export(self, span_texts: Sequence[str], dropped: int) -> bool:
            self.calls += 1
            if self.calls == 1:
                raise OSError("disk full")
            return super().export(span_texts, dropped)

    recorder = Recorder()
    sink = FlakySink(tmp_path, "wtest", RESOURCE)
    exporter = BackgroundExporter(recorder, sink, interval_s=3600, batch_size=4)
    _submit(recorder, 10)
    exporter.shutdown()
    assert recorder.enabled
    assert exporter.failed_batches == 1 and recorder.dropped == 4
    requests = _read_lines(sink.path)
    assert sorted(_root_seqs(requests)) == list(range(4, 10))
    assert _scope_dropped(requests[0]) == 4


def test_file_is_collector_shaped_and_parses_with_opentelemetry_proto(tmp_path: Path) -> None:
    recorder = Recorder()
    sink = create_sink(build_resource(RESOURCE), out_dir=tmp_path)
    assert isinstance(sink, JsonLinesFileSink)
    exporter = BackgroundExporter(recorder, sink, interval_s=3600)
    _submit(recorder, 3)
    exporter.shutdown()

    assert sink.path == tmp_path / "traces" / f"kvtrace-wtest-{os.getpid()}.jsonl"
    for line in sink.path.read_bytes().splitlines():
        doc = orjson.loads(line)
        span = doc["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
        assert len(span["traceId"]) == 32 and len(span["spanId"]) == 16  # hex, not base64
        assert isinstance(span["startTimeUnixNano"], str)
        # parsed by opentelemetry-proto's JSON support (json_format, ids hex -> bytes), then re-encoded
        parsed = json_line_to_request(line)
        assert json_format.MessageToDict(parsed)["resourceSpans"][0]["scopeSpans"][0]["scope"]["name"] == "otel_kvtrace"
        resource = {a.key: a.value for a in parsed.resource_spans[0].resource.attributes}
        assert resource["service.name"].string_value == "kvtrace"
        assert resource["process.pid"].int_value == os.getpid()
        assert "host.name" in resource


# ---- configuration --------------------------------------------------------------------------------
def test_sink_selection_from_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in (
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        "OTEL_SDK_DISABLED",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OTEL_KVTRACE_DATA_DIR", str(tmp_path / "data"))
    sink = create_sink(RESOURCE)
    assert isinstance(sink, JsonLinesFileSink)
    assert sink.path.parent == tmp_path / "data" / "traces"

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:1/v1/traces")
    assert isinstance(create_sink(RESOURCE).transport, OtlpHttpSink)  # http/protobuf is the default
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    assert isinstance(create_sink(RESOURCE).transport, OtlpGrpcSink)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")  # traces-specific wins
    assert isinstance(create_sink(RESOURCE).transport, OtlpHttpSink)
    assert isinstance(create_sink(RESOURCE, protocol="grpc").transport, OtlpGrpcSink)  # argument wins

    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert isinstance(create_sink(RESOURCE), NullSink)


def test_bad_values_are_logged_and_defaulted(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "carrier-pigeon")
    monkeypatch.setenv("OTEL_KVTRACE_EXPORT_BATCH_SIZE", "many")
    monkeypatch.setenv("OTEL_KVTRACE_EXPORT_INTERVAL_MS", "-5")
    with caplog.at_level(logging.WARNING, logger="otel_kvtrace"):
        exporter = create_exporter(Recorder(), RESOURCE)
    exporter.shutdown(timeout_s=1)
    assert isinstance(exporter.sink.transport, OtlpHttpSink)
    assert exporter.batch_size == 256 and exporter.interval_s == 0.2
    text = caplog.text
    for name in ("OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_KVTRACE_EXPORT_BATCH_SIZE", "OTEL_KVTRACE_EXPORT_INTERVAL_MS"):
        assert name in text


def test_bad_protocol_argument_names_the_option() -> None:
    with pytest.raises(ValueError, match="protocol"):
        create_sink(RESOURCE, endpoint="http://127.0.0.1:1", protocol="http/json")


def test_resource_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=lab,kvtrace.role=kv_consumer")
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    resource = build_resource({"kvtrace.source": "upstream"})
    assert resource["service.name"] == "kvtrace"
    assert resource["deployment.environment"] == "lab" and resource["kvtrace.role"] == "kv_consumer"
    assert resource["kvtrace.source"] == "upstream"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "decode-node-3")
    monkeypatch.setenv("OTEL_KVTRACE_RUN_ID", "deploy-7")
    resource = build_resource({})
    assert resource["service.name"] == "decode-node-3"
    assert resource["kvtrace.run_id"] == "deploy-7"


def test_file_name_uses_safe_run_id(tmp_path: Path) -> None:
    assert trace_file_path(tmp_path, "host/1 2", 7) == tmp_path / "traces" / "kvtrace-host_1_2-7.jsonl"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork (POSIX)")
def test_forked_child_exports_its_own_records_to_its_own_file(tmp_path: Path) -> None:
    recorder = Recorder()
    sink = JsonLinesFileSink(tmp_path, "wtest", RESOURCE)
    exporter = BackgroundExporter(recorder, sink, interval_s=3600)
    _submit(recorder, 3)  # pending in the parent at fork time: the child must not export them
    pid = os.fork()
    if pid == 0:  # child
        code = 1
        try:
            _submit(recorder, 4, start_seq=100)
            code = 0 if exporter.shutdown(timeout_s=10) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    child_file = trace_file_path(tmp_path, "wtest", pid)
    assert sorted(_root_seqs(_read_lines(child_file))) == [100, 101, 102, 103]
    assert exporter.shutdown(timeout_s=10)
    assert sorted(_root_seqs(_read_lines(sink.path))) == [0, 1, 2]
    assert sink.path != child_file


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork (POSIX)")
def test_a_multiprocessing_child_drains_at_its_os_exit(tmp_path: Path) -> None:
    """A multiprocessing child leaves through ``os._exit`` (no atexit): the exporter's multiprocessing
    finalizer still drains what the child recorded (vLLM's forked engine-core and worker processes)."""
    import multiprocessing as mp

    recorder = Recorder()
    exporter = BackgroundExporter(recorder, JsonLinesFileSink(tmp_path, "wtest", RESOURCE), interval_s=3600)
    child = mp.get_context("fork").Process(target=_submit, args=(recorder, 5, 200))
    child.start()
    child.join(30)
    assert child.exitcode == 0
    assert sorted(_root_seqs(_read_lines(trace_file_path(tmp_path, "wtest", child.pid)))) == [200, 201, 202, 203, 204]
    assert exporter.shutdown(timeout_s=10)


def _submit_and_report(recorder: Recorder, exporter: BackgroundExporter, n: int, first_seq: int, conn: object) -> None:
    _submit(recorder, n, first_seq)
    exporter.shutdown(timeout_s=10)
    conn.send(_counts(exporter))  # type: ignore[attr-defined]


def _counts(exporter: BackgroundExporter) -> tuple[int, int, int, int, int]:
    s = exporter.stats()
    return s.recorded, s.delivered, s.spooled, s.dropped, s.pending


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork (POSIX)")
def test_a_forked_child_s_accounting_counts_only_its_own_records(tmp_path: Path) -> None:
    """The parent's exported and pending records are the parent's: the child's summary balances over
    what the child recorded (before: the parent's counts plus the child's, UNBALANCED)."""
    import multiprocessing as mp

    recorder = Recorder()
    exporter = BackgroundExporter(recorder, JsonLinesFileSink(tmp_path, "ftest", RESOURCE), interval_s=3600)
    _submit(recorder, 5, 0)
    exporter.force_flush()
    _submit(recorder, 3, 5)  # pending at the fork
    ctx = mp.get_context("fork")
    parent_end, child_end = ctx.Pipe()
    child = ctx.Process(target=_submit_and_report, args=(recorder, exporter, 2, 100, child_end))
    child.start()
    assert parent_end.poll(30), "the child never reported"
    child_counts = parent_end.recv()
    child.join(30)
    assert child_counts == (2, 2, 0, 0, 0)
    assert sorted(_root_seqs(_read_lines(trace_file_path(tmp_path, "ftest", child.pid)))) == [100, 101]
    assert exporter.shutdown(timeout_s=10)
    assert _counts(exporter) == (8, 8, 0, 0, 0)
