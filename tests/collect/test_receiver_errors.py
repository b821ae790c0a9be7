"""Malformed requests get protocol errors and are counted; the receiver keeps serving; taken ports fail clearly."""

from __future__ import annotations

import gzip
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import requests
from google.rpc.status_pb2 import Status
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from otel_kvtrace.collect import PortInUseError, Receiver
from otel_kvtrace.export.otlp_json import request_to_json_line
from tests.collect.helpers import collected_span_ids

EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
PROTO = {"Content-Type": "application/x-protobuf"}
JSON = {"Content-Type": "application/json"}


def _request(n: int, seed: int = 1) -> ExportTraceServiceRequest:
    req = ExportTraceServiceRequest()
    ss = req.resource_spans.add().scope_spans.add()
    for i in range(n):
        ss.spans.add(
            name="backend_submit",
            trace_id=bytes([seed]) * 12 + i.to_bytes(4, "big"),
            span_id=(seed * 1000 + i + 1).to_bytes(8, "big"),
            start_time_unix_nano=10,
            end_time_unix_nano=20,
        )
    return req


@pytest.fixture
def rx(tmp_path: Path) -> Iterator[Receiver]:
    receiver = Receiver(tmp_path, grpc_port=0, http_port=0).start()
    yield receiver
    receiver.stop()


def _grpc_export(rx: Receiver, body: bytes) -> bytes:
    with grpc.insecure_channel(f"127.0.0.1:{rx.grpc_port}") as ch:
        return ch.unary_unary(EXPORT)(body, timeout=10)


def test_malformed_grpc_is_invalid_argument_counted_and_serving_continues(rx: Receiver, tmp_path: Path) -> None:
    for garbage in (b"\x0a\xff", b"\xff\xff\xff\xff"):
        with pytest.raises(grpc.RpcError) as err:
            _grpc_export(rx, garbage)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    good = _request(3)
    resp = ExportTraceServiceResponse.FromString(_grpc_export(rx, good.SerializeToString()))
    assert not resp.HasField("partial_success")
    stats = rx.stop()
    assert (stats.malformed_grpc, stats.grpc_requests, stats.spans_written) == (2, 1, 3)
    assert len(collected_span_ids(tmp_path)) == 3


@pytest.mark.parametrize(
    ("path", "headers", "body", "status"),
    [
        ("/v1/traces", PROTO, b"\x0a\xff", 400),
        ("/v1/traces", JSON, b"{not json", 400),
        ("/v1/traces", JSON, b'{"resourceSpans":[{"scopeSpans":[{"spans":[{"traceId":"zz"}]}]}]}', 400),
        ("/v1/traces", JSON, b"[1, 2]", 400),
        ("/v1/traces", {"Content-Type": "text/plain"}, b"hello", 415),
        ("/v1/logs", PROTO, b"\x0a\x00", 404),
        ("/v1/traces", {"Content-Type": "text/plain"}, b"POST /v1/traces HTTP/1.1", 415),
        ("/v1/traces", {**PROTO, "Content-Encoding": "gzip"}, b"not gzip", 400),
        ("/v1/traces", {**PROTO, "Content-Encoding": "br"}, b"x", 400),
    ],
)
def test_malformed_http_gets_4xx_with_status_body_and_is_counted(
    rx: Receiver, path: str, headers: dict[str, str], body: bytes, status: int
) -> None:
    url = f"http://127.0.0.1:{rx.http_port}"
    with requests.Session() as s:  # one keep-alive connection: an error must not break it
        r = s.post(url + path, data=body, headers=headers)
        assert r.status_code == status
        if r.headers["Content-Type"] == "application/x-protobuf":
            assert Status.FromString(r.content).message
        else:
            assert r.json()["message"]
        ok = s.post(url + "/v1/traces", data=_request(2).SerializeToString(), headers=PROTO)
        assert ok.status_code == 200
    stats = rx.stop()
    assert (stats.malformed_http, stats.http_requests, stats.spans_written) == (1, 1, 2)


def test_http_accepts_json_and_gzip_and_answers_in_kind(rx: Receiver, tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{rx.http_port}/v1/traces"
    r = requests.post(url, data=request_to_json_line(_request(2, seed=1)), headers=JSON)
    assert r.status_code == 200 and r.headers["Content-Type"] == "application/json"
    assert r.json() == {}
    gz = gzip.compress(_request(3, seed=2).SerializeToString())
    r = requests.post(url, data=gz, headers={**PROTO, "Content-Encoding": "gzip"})
    assert r.status_code == 200
    ExportTraceServiceResponse.FromString(r.content)
    rx.stop()
    assert len(collected_span_ids(tmp_path)) == 5


def test_oversized_http_request_is_413_without_reading_it(tmp_path: Path) -> None:
    with Receiver(tmp_path, grpc_port=None, http_port=0, max_request_bytes=1000) as rx:
        r = requests.post(
            f"http://127.0.0.1:{rx.http_port}/v1/traces", data=_request(100).SerializeToString(), headers=PROTO
        )
        assert r.status_code == 413
        assert rx.stats().malformed_http == 1


def test_spans_with_bad_id_lengths_are_rejected_as_partial_success(rx: Receiver, tmp_path: Path) -> None:
    req = _request(3)
    ss = req.resource_spans[0].scope_spans[0]
    ss.spans[0].trace_id = b"\x01" * 8  # too short
    ss.spans[1].parent_span_id = b"\x02" * 3  # neither empty nor 8 bytes
    resp = ExportTraceServiceResponse.FromString(_grpc_export(rx, req.SerializeToString()))
    assert resp.partial_success.rejected_spans == 2
    stats = rx.stop()
    assert (stats.spans_rejected, stats.spans_written, stats.lines_written) == (2, 1, 1)
    assert len(collected_span_ids(tmp_path)) == 1


def _listening_socket() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


@pytest.mark.parametrize("option", ["--grpc-port", "--http-port"])
def test_port_taken_exits_2_naming_port_and_option(tmp_path: Path, option: str) -> None:
    taken = _listening_socket()
    port = taken.getsockname()[1]
    other = "--http-port" if option == "--grpc-port" else "--grpc-port"
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "otel_kvtrace.cli", "collect", "--out", str(tmp_path),
             option, str(port), other, "0"],
            capture_output=True, text=True, check=False, timeout=60,
        )
    finally:
        taken.close()
    assert proc.returncode == 2, proc.stderr
    assert option in proc.stderr and str(port) in proc.stderr and "already in use" in proc.stderr


def test_port_taken_api_raises_and_releases_the_other_port(tmp_path: Path) -> None:
    taken = _listening_socket()
    port = taken.getsockname()[1]
    try:
        rx = Receiver(tmp_path, grpc_port=0, http_port=port)
        with pytest.raises(PortInUseError) as err:
            rx.start()
        assert err.value.option == "--http-port" and err.value.port == port
    finally:
        taken.close()


def test_request_without_spans_is_answered_but_writes_no_line(rx: Receiver, tmp_path: Path) -> None:
    r = requests.post(f"http://127.0.0.1:{rx.http_port}/v1/traces", data=b"", headers=PROTO)
    assert r.status_code == 200
    stats = rx.stop()
    assert (stats.http_requests, stats.lines_written) == (1, 0)
    assert not rx.path.exists()  # no empty file: `kvtrace report DIR` must not trip over one


def test_unwritable_out_exits_2_naming_the_option(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    proc = subprocess.run(
        [sys.executable, "-m", "otel_kvtrace.cli", "collect", "--out", str(not_a_dir / "traces"),
         "--grpc-port", "0", "--http-port", "0"],
        capture_output=True, text=True, check=False, timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert "--out" in proc.stderr and "Traceback" not in proc.stderr
