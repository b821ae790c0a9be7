"""Real OTLP receivers on loopback that misbehave on purpose: slow, refusing, silent, killed and revived.

Each keeps every span it acknowledged, so a test can count distinct (trace id, span id) pairs.
"""

from __future__ import annotations

import socket
import threading
import time
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from google.rpc.error_details_pb2 import RetryInfo
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from otel_kvtrace.record.model import RECV_ROOT_SPAN


def partial_response(acked: "Acked", req: ExportTraceServiceRequest, reject_one: bool) -> ExportTraceServiceResponse:
    """Keep the request's spans; with ``reject_one`` drop its last span and say so (OTLP partial success)."""
    resp = ExportTraceServiceResponse()
    if reject_one:
        last = req.resource_spans[-1].scope_spans[-1].spans
        del last[len(last) - 1]
        resp.partial_success.rejected_spans = 1
        resp.partial_success.error_message = "test receiver: one span dropped"
        with acked.lock:
            acked.partials += 1
    acked.add(req)
    return resp


def answer_ok(handler: BaseHTTPRequestHandler, response: ExportTraceServiceResponse | None = None) -> None:
    """The OTLP/HTTP success answer: 200 with a protobuf ``ExportTraceServiceResponse`` (empty: all taken)."""
    payload = (response or ExportTraceServiceResponse()).SerializeToString()
    handler.send_response(200)
    handler.send_header("Content-Type", "application/x-protobuf")
    handler.send_header("Content-Length", str(len(payload)))
    handler.end_headers()
    handler.wfile.write(payload)


class Acked:
    """Spans of every request the receiver answered with success."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ids: set[tuple[bytes, bytes]] = set()
        self.roots: set[bytes] = set()
        self.requests = 0
        self.refused = 0
        self.partials = 0  # answers with partial_success.rejected_spans = 1

    def add(self, req: ExportTraceServiceRequest) -> None:
        with self.lock:
            self.requests += 1
            for rs in req.resource_spans:
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        self.ids.add((span.trace_id, span.span_id))
                        if span.name == RECV_ROOT_SPAN:
                            self.roots.add(span.trace_id)


class GrpcReceiver:
    """grpcio TraceService: optional sleep per request, the first ``refuse`` requests answered with
    ``code`` (and a RetryInfo delay), a receive limit; ``stop()`` kills it, ``start()`` revives it on
    the same port."""

    def __init__(self, *, sleep_s: float = 0.0, refuse: int = 0, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE,
                 retry_delay_s: float | None = None, max_receive_bytes: int | None = None,
                 reject_one_span: bool = False) -> None:
        self.acked = Acked()
        self.reject_one_span = reject_one_span
        self.sleep_s = sleep_s
        self.refuse = refuse
        self.code = code
        self.retry_delay_s = retry_delay_s
        self.max_receive_bytes = max_receive_bytes
        self.port = 0
        self.server: grpc.Server | None = None
        self.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        receiver = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: ExportTraceServiceRequest, context: Any) -> ExportTraceServiceResponse:  # noqa: N802
                if receiver.sleep_s:
                    time.sleep(receiver.sleep_s)
                with receiver.acked.lock:
                    refuse = receiver.acked.refused < receiver.refuse
                    if refuse:
                        receiver.acked.refused += 1
                if refuse:
                    if receiver.retry_delay_s is not None:
                        info = RetryInfo()
                        info.retry_delay.FromNanoseconds(int(receiver.retry_delay_s * 1e9))
                        context.set_trailing_metadata((("google.rpc.retryinfo-bin", info.SerializeToString()),))
                    context.abort(receiver.code, "test receiver: try later")
                return partial_response(receiver.acked, request, receiver.reject_one_span)

        options = [("grpc.max_receive_message_length", self.max_receive_bytes)] if self.max_receive_bytes else []
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=options)
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        self.server.start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(grace=None).wait()
            self.server = None


class HttpReceiver:
    """http.server OTLP/HTTP: the first ``refuse`` requests get ``status`` with ``Retry-After``."""

    def __init__(self, *, refuse: int = 0, status: int = 503, retry_after: str | None = "0",
                 sleep_s: float = 0.0, reject_one_span: bool = False) -> None:
        self.acked = Acked()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if sleep_s:
                    time.sleep(sleep_s)
                with receiver.acked.lock:
                    refused = receiver.acked.refused < refuse
                    if refused:
                        receiver.acked.refused += 1
                if refused:
                    self.send_response(status)
                    if retry_after is not None:
                        self.send_header("Retry-After", retry_after)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                answer_ok(self, partial_response(receiver.acked, ExportTraceServiceRequest.FromString(body),
                                                 reject_one_span))

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class BlackHole:
    """Accepts TCP connections and never answers (reads and discards, keeps them open)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.endpoint = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        self._stop = False
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.conns.append(conn)  # never read: the sender's buffers fill, no reply ever comes

    def stop(self) -> None:
        self._stop = True
        self.thread.join(2)
        for conn in self.conns:
            conn.close()
        self.sock.close()
