"""OTLP export over real gRPC and real HTTP to loopback receivers that decode with opentelemetry-proto."""

from __future__ import annotations

import gzip
import threading
import zlib
from collections.abc import Iterator
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
import pytest
from export_records import fill_record
from fault_receivers import answer_ok
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from otel_kvtrace.export import OtlpGrpcSink, OtlpHttpSink, SpanBuilder, create_exporter, create_sink
from otel_kvtrace.record.model import RECV_ROOT_SPAN, TaskRecord
from otel_kvtrace.record.recorder import Recorder

RESOURCE = {"kvtrace.source": "replica", "kvtrace.run_id": "otlp-test", "kvtrace.cfg.num_layers": 8}


class Received:
    """Requests a loopback receiver decoded, with a condition to wait on."""

    def __init__(self) -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        self.paths: list[str] = []
        self.cond = threading.Condition()

    def add(self, req: ExportTraceServiceRequest, path: str = "") -> None:
        with self.cond:
            self.requests.append(req)
            self.paths.append(path)
            self.cond.notify_all()

    def spans(self) -> list[Any]:
        return [s for r in self.requests for rs in r.resource_spans for ss in rs.scope_spans for s in ss.spans]


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, received: Received) -> None:
        self.received = received

    def Export(self, request: ExportTraceServiceRequest, context: Any) -> ExportTraceServiceResponse:  # noqa: N802
        self.received.add(request)
        return ExportTraceServiceResponse()


@pytest.fixture
def grpc_receiver() -> Iterator[tuple[str, Received]]:
    received = Received()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(received), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"http://127.0.0.1:{port}", received
    finally:
        server.stop(grace=None)


@pytest.fixture
def http_receiver() -> Iterator[tuple[str, Received]]:
    received = Received()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            encoding = self.headers.get("Content-Encoding", "")
            if encoding == "gzip":
                body = gzip.decompress(body)
            elif encoding == "deflate":
                body = zlib.decompress(body)
            if self.path != "/v1/traces" or self.headers.get("Content-Type") != "application/x-protobuf":
                self.send_response(404)
                self.end_headers()
                return
            received.add(ExportTraceServiceRequest.FromString(body), self.path)
            answer_ok(self)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", received
    finally:
        server.shutdown()
        server.server_close()


def _record_tasks(recorder: Recorder, n: int) -> list[TaskRecord]:
    """Submit n tasks; return independent copies of what was submitted (the pool recycles the originals)."""
    copies = []
    for i in range(n):
        rec = recorder.new_record()
        fill_record(rec, seq=i, step=i // 8, layer_id=i % 8, t0=recorder.clock())
        copies.append(fill_record(TaskRecord(), seq=i, step=i // 8, layer_id=i % 8, t0=rec.t_enqueue))
        recorder.submit(rec)
    return copies


def _check_received(received: Received, recorder: Recorder, submitted: list[TaskRecord]) -> None:
    spans = received.spans()
    builder = SpanBuilder(recorder.anchor)
    expected = [s for rec in submitted for s in builder.build(rec)]
    assert len(spans) == len(expected)
    got = {(s.trace_id.hex(), s.span_id.hex()): s for s in spans}
    for doc in expected:
        span = got[(doc["traceId"], doc["spanId"])]
        assert span.name == doc["name"]
        assert span.start_time_unix_nano == int(doc["startTimeUnixNano"])
        assert span.end_time_unix_nano == int(doc["endTimeUnixNano"])
        assert span.parent_span_id.hex() == doc.get("parentSpanId", "")
        assert [a.key for a in span.attributes] == [a["key"] for a in doc.get("attributes", [])]
    roots = [s for s in spans if s.name == RECV_ROOT_SPAN]
    assert len(roots) == len(submitted)
    resource = {a.key: a.value for a in received.requests[0].resource_spans[0].resource.attributes}
    assert resource["kvtrace.source"].string_value == "replica"
    assert resource["kvtrace.run_id"].string_value == "otlp-test"
    assert resource["kvtrace.cfg.num_layers"].int_value == 8
    assert resource["service.name"].string_value == "kvtrace"
    scope = received.requests[0].resource_spans[0].scope_spans[0].scope
    assert scope.name == "otel_kvtrace"
    assert scope.attributes[0].key == "kvtrace.exporter.dropped"


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_export_over_real_otlp(
    protocol: str, grpc_receiver: tuple[str, Received], http_receiver: tuple[str, Received]
) -> None:
    endpoint, received = grpc_receiver if protocol == "grpc" else http_receiver
    recorder = Recorder()
    exporter = create_exporter(recorder, RESOURCE, endpoint=endpoint, protocol=protocol)
    assert isinstance(exporter.sink.transport, OtlpGrpcSink if protocol == "grpc" else OtlpHttpSink)
    exporter.batch_size = 7  # several requests
    submitted = _record_tasks(recorder, 40)
    assert exporter.shutdown(timeout_s=20)
    # one resource block per batch of 7; the sender may carry several spooled batches in one request
    assert sum(len(r.resource_spans) for r in received.requests) >= 6
    _check_received(received, recorder, submitted)
    assert recorder.dropped == 0


def test_endpoint_and_protocol_from_environment(
    monkeypatch: pytest.MonkeyPatch, grpc_receiver: tuple[str, Received], http_receiver: tuple[str, Received]
) -> None:
    grpc_endpoint, grpc_received = grpc_receiver
    http_endpoint, http_received = http_receiver
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", grpc_endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    recorder = Recorder()
    exporter = create_exporter(recorder, RESOURCE)
    submitted = _record_tasks(recorder, 5)
    exporter.shutdown(timeout_s=20)
    _check_received(grpc_received, recorder, submitted)

    # Base endpoint for http/protobuf: the SDK appends /v1/traces; traces-specific protocol wins.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", http_endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    recorder = Recorder()
    exporter = create_exporter(recorder, RESOURCE)
    assert isinstance(exporter.sink.transport, OtlpHttpSink)
    submitted = _record_tasks(recorder, 5)
    exporter.shutdown(timeout_s=20)
    assert http_received.paths == ["/v1/traces"]
    _check_received(http_received, recorder, submitted)


def test_http_compression_from_environment(
    monkeypatch: pytest.MonkeyPatch, http_receiver: tuple[str, Received]
) -> None:
    endpoint, received = http_receiver
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "gzip")
    recorder = Recorder()
    sink = create_sink(RESOURCE, endpoint=endpoint, protocol="http/protobuf")
    builder = SpanBuilder(recorder.anchor)
    assert sink.export([builder.build_json(fill_record(TaskRecord()))], 0)
    sink.shutdown()
    assert len(received.spans()) == 12


def test_refusing_endpoint_keeps_the_batch_in_the_spool(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A dead endpoint: nothing is lost or silently dropped; the batch waits on disk, counted as spooled."""
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "1")
    recorder = Recorder()
    exporter = create_exporter(recorder, RESOURCE, endpoint=f"http://127.0.0.1:{port}", protocol="http/protobuf")
    _record_tasks(recorder, 10)
    with caplog.at_level("WARNING", logger="otel_kvtrace"):
        assert exporter.shutdown(timeout_s=1) is False  # not delivered
    stats = exporter.stats()
    assert (stats.recorded, stats.delivered, stats.spooled, stats.dropped) == (10, 0, 10, 0)
    assert recorder.dropped == 0
    assert len(list(exporter.sink.spool.directory.glob("*-t10.jsonl"))) == 1
    assert sum("Resend with: kvtrace resend" in r.getMessage() for r in caplog.records) == 1


def test_spool_off_sends_directly_and_counts_a_failed_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """``OTEL_KVTRACE_SPOOL_MAX_MB=0``: the old direct path; a lost batch is still counted."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "1")
    monkeypatch.setenv("OTEL_KVTRACE_SPOOL_MAX_MB", "0")
    recorder = Recorder()
    exporter = create_exporter(recorder, RESOURCE, endpoint=f"http://127.0.0.1:{port}", protocol="http/protobuf")
    assert isinstance(exporter.sink, OtlpHttpSink)
    _record_tasks(recorder, 10)
    assert exporter.shutdown(timeout_s=10) is False
    assert exporter.failed_batches == 1 and recorder.dropped == 10
    stats = exporter.stats()
    assert stats.balanced and stats.dropped == 10, stats


def test_sdk_readable_span_path_sends_the_same_spans(http_receiver: tuple[str, Received]) -> None:
    """The ReadableSpan encoding (bench candidate, fallback for SDKs without the bytes client) sent by the
    unmodified SDK exporter arrives as the same spans as our directly built request."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource

    from otel_kvtrace.export.encode import spans_to_readable_spans, texts_to_spans
    from otel_kvtrace.record.model import Outcome

    endpoint, received = http_receiver
    builder = SpanBuilder(Recorder().anchor)
    failed = fill_record(TaskRecord(), layer_id=6, outcome=Outcome.ERROR, error=OSError("x"))
    records = [fill_record(TaskRecord()), failed]
    texts = [builder.build_json(rec) for rec in records]
    sink = OtlpHttpSink(RESOURCE, endpoint)
    assert sink.export(texts, 0)
    sink.shutdown()
    sdk = OTLPSpanExporter(endpoint=f"{endpoint}/v1/traces")
    readable = spans_to_readable_spans(texts_to_spans(texts), Resource(RESOURCE), 0)
    assert sdk.export(readable).name == "SUCCESS"
    sdk.shutdown()
    ours, theirs = (list(r.resource_spans[0].scope_spans[0].spans) for r in received.requests)
    assert len(ours) == len(theirs) == 24
    for a, b in zip(ours, theirs, strict=True):
        for span in (a, b):  # the SDK also sends W3C trace flags on spans and links
            span.ClearField("flags")
            for link in span.links:
                link.ClearField("flags")
        assert a == b, a.name
