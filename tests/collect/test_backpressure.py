"""A writer that cannot keep up: the queue stays bounded, senders are told to retry, nothing is lost.

The output file is a named pipe that the test stops reading, so the writer really blocks on the disk
side; no hook inside the receiver is involved.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import grpc
import requests
from google.rpc.error_details_pb2 import RetryInfo
from google.rpc.status_pb2 import Status
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
)
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from otel_kvtrace.collect import Receiver, collected_file_name
from otel_kvtrace.export.otlp_json import json_line_to_request

EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
MAX_QUEUE = 64 * 1024


def _request(seed: int, n: int = 40) -> ExportTraceServiceRequest:
    req = ExportTraceServiceRequest()
    ss = req.resource_spans.add().scope_spans.add()
    for i in range(n):
        sp = ss.spans.add(name="save_cpu_wait", trace_id=seed.to_bytes(8, "big") + i.to_bytes(8, "big"),
                          span_id=(seed * 1000 + i + 1).to_bytes(8, "big"))
        sp.attributes.add(key="kvtrace.correlation_id").value.string_value = f"run/dp0/gva/s{seed}/l{i}" * 4
    return req


def _span_ids(req: ExportTraceServiceRequest) -> list[tuple[bytes, bytes]]:
    return [(s.trace_id, s.span_id) for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]


def _post(url: str, req: ExportTraceServiceRequest) -> requests.Response:
    return requests.post(url, data=req.SerializeToString(), headers={"Content-Type": "application/x-protobuf"},
                         timeout=60)


def test_full_queue_answers_503_and_resource_exhausted_then_retries_succeed(tmp_path: Path) -> None:
    fifo = tmp_path / collected_file_name()
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # lets the receiver open it; never read until later
    rx = Receiver(tmp_path, grpc_port=0, http_port=0, max_queue_bytes=MAX_QUEUE, ack_timeout_s=0.5).start()
    url = f"http://127.0.0.1:{rx.http_port}/v1/traces"
    # Senders at once: the writer blocks on the full pipe, the queue fills, the rest bounce at once.
    requests_sent = {seed: _request(seed) for seed in range(1, 80)}
    answers: dict[int, requests.Response] = {}
    threads = [threading.Thread(target=lambda s=seed: answers.__setitem__(s, _post(url, requests_sent[s])))
               for seed in requests_sent]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    codes = {seed: Status.FromString(r.content).code for seed, r in answers.items() if r.status_code == 503}
    full = [r for seed, r in answers.items() if codes.get(seed) == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]]
    assert full, "queue never filled"
    assert full[0].headers["Retry-After"] == "1"
    # 200 only for what went into the pipe before it filled; the others were told to retry (UNAVAILABLE)
    assert {r.status_code for r in answers.values()} <= {200, 503}
    assert grpc.StatusCode.UNAVAILABLE.value[0] in codes.values()  # waited for a write that did not come
    assert rx.stats().queue_high_water_bytes <= MAX_QUEUE + len(_request(1).SerializeToString()) * 3
    # a request whose line the writer already holds may still be written later: its retry is a duplicate
    maybe_written = [sid for seed, r in answers.items() if b"in progress" in r.content
                     for sid in _span_ids(requests_sent[seed])]
    accepted = [sid for seed, r in answers.items() if r.status_code == 200 for sid in _span_ids(requests_sent[seed])]

    with grpc.insecure_channel(f"127.0.0.1:{rx.grpc_port}") as ch:
        call = ch.unary_unary(EXPORT).with_call
        try:
            call(_request(999).SerializeToString(), timeout=10)
            raise AssertionError("gRPC export accepted into a full queue")
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            retry = dict(err.trailing_metadata())["google.rpc.retryinfo-bin"]
            assert RetryInfo.FromString(retry).retry_delay.ToNanoseconds() > 0

    # A real SDK exporter now hits the full queue; it must retry until the pipe is drained, then succeed.
    exported: dict[str, object] = {}
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=url, timeout=30)))

    def export_one() -> None:
        with provider.get_tracer("t").start_as_current_span("gate_npu_sync") as span:
            ctx = span.get_span_context()
        exported["ids"] = (ctx.trace_id.to_bytes(16, "big"), ctx.span_id.to_bytes(8, "big"))

    sdk_thread = threading.Thread(target=export_one)
    sdk_thread.start()
    sdk_thread.join(0.5)
    assert sdk_thread.is_alive(), "the SDK export should be waiting on 503 retries"

    chunks: list[bytes] = []
    os.set_blocking(reader, True)
    drain = threading.Thread(target=lambda: chunks.extend(iter(lambda: os.read(reader, 1 << 16), b"")))
    drain.start()
    sdk_thread.join(30)
    assert not sdk_thread.is_alive()
    stats = rx.stop()
    drain.join(30)
    os.close(reader)

    written = [sid for line in b"".join(chunks).splitlines() for sid in _span_ids(json_line_to_request(line))]
    expected = accepted + [exported["ids"]]
    assert set(expected) <= set(written)  # every acknowledged span is in the file
    assert set(written) - set(expected) <= set(maybe_written)  # and nothing refused outright
    assert stats.refused_full >= 2  # an HTTP post, the gRPC call (and SDK attempts)
    assert stats.spans_written == len(written)
    provider.shutdown()
