"""OTLP/HTTP ``POST /v1/traces`` endpoint (``application/x-protobuf`` and ``application/json``).

Answers follow the OTLP/HTTP spec: 200 with an ``ExportTraceServiceResponse`` in the request's encoding;
400 with a ``google.rpc.Status`` body for a body that is not an OTLP request; 503 with ``Retry-After`` when
the write queue is full or the receiver is stopping (the exporters retry on 503).
"""

from __future__ import annotations

import socket
import threading
import zlib
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from google.protobuf import json_format
from google.rpc.status_pb2 import Status

from otel_kvtrace.collect.validate import (
    AcceptFn,
    MalformedRequest,
    decode_json,
    decode_protobuf,
)

TRACES_PATH = "/v1/traces"
_PROTOBUF = "application/x-protobuf"
_JSON = "application/json"
_GRPC_INVALID_ARGUMENT = 3
_GRPC_RESOURCE_EXHAUSTED = 8
_GRPC_UNAVAILABLE = 14


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # idle keep-alive connections must not hold the process at exit
    allow_reuse_address = False  # a taken port must fail to bind

    def __init__(self, address: tuple[str, int], endpoint: HttpEndpoint) -> None:
        self.endpoint = endpoint
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"  # keep-alive, as the OTLP exporters' sessions expect
    timeout = 60  # idle keep-alive connections are closed after this many seconds

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the receiver counts; per-request access logs would flood the terminal

    def do_POST(self) -> None:
        self.server.endpoint.handle_post(self)

    def do_GET(self) -> None:
        self.server.endpoint.reply_error(self, HTTPStatus.METHOD_NOT_ALLOWED, "use POST /v1/traces", _JSON)

    do_PUT = do_DELETE = do_PATCH = do_GET


class HttpEndpoint:
    """A threading HTTP server bound to ``host:port`` (port 0 picks a free port)."""

    def __init__(
        self,
        host: str,
        port: int,
        accept: AcceptFn,
        on_malformed: Callable[[], None],
        max_request_bytes: int,
        retry_after_s: int = 1,
    ) -> None:
        self._accept = accept
        self._on_malformed = on_malformed
        self._max_request_bytes = max_request_bytes
        self._retry_after_s = retry_after_s
        self._server = _Server((host, port), self)
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.1}, name="kvtrace-collect-http", daemon=True
        )
        self._inflight = 0
        self._cond = threading.Condition()

    def start(self) -> None:
        self._thread.start()

    def stop(self, grace_s: float) -> None:
        """Stop accepting connections and wait up to ``grace_s`` for requests being handled."""
        if self._thread.is_alive():
            self._server.shutdown()  # blocks until serve_forever returns, so only when it runs
        self._server.server_close()
        with self._cond:
            self._cond.wait_for(lambda: self._inflight == 0, timeout=grace_s)

    # --- request handling -------------------------------------------------------------------

    def handle_post(self, h: _Handler) -> None:
        with self._cond:
            self._inflight += 1
        try:
            self._handle_post(h)
        finally:
            with self._cond:
                self._inflight -= 1
                self._cond.notify_all()

    def _handle_post(self, h: _Handler) -> None:
        content_type = (h.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        reply_type = _JSON if content_type == _JSON else _PROTOBUF
        length_header = h.headers.get("Content-Length")
        if length_header is None or not length_header.isdigit():
            h.close_connection = True  # the body's end is unknown, so the connection cannot be reused
            self._malformed(h, HTTPStatus.LENGTH_REQUIRED, "Content-Length is required", reply_type)
            return
        length = int(length_header)
        if length > self._max_request_bytes:
            h.close_connection = True  # the body is not read, so the connection cannot be reused
            self._malformed(
                h,
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                f"request of {length} bytes exceeds the limit of {self._max_request_bytes}",
                reply_type,
            )
            return
        body = h.rfile.read(length)  # read even when refusing, so a keep-alive connection stays in sync
        if h.path.split("?")[0] != TRACES_PATH:
            message = f"unknown path {h.path!r}; OTLP traces go to {TRACES_PATH}"
            self._malformed(h, HTTPStatus.NOT_FOUND, message, reply_type)
            return
        if content_type not in (_PROTOBUF, _JSON):
            self._malformed(
                h,
                HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
                f"Content-Type {content_type!r} not supported; use {_PROTOBUF} or {_JSON}",
                reply_type,
            )
            return
        try:
            body = self._decompress(body, (h.headers.get("Content-Encoding") or "").strip().lower())
            req = decode_json(body) if content_type == _JSON else decode_protobuf(body)
        except MalformedRequest as exc:
            self._malformed(h, HTTPStatus.BAD_REQUEST, str(exc), reply_type)
            return
        result = self._accept(req, len(body))
        if result.response is not None:
            if reply_type == _JSON:
                payload = json_format.MessageToJson(result.response, indent=None).encode()
            else:
                payload = result.response.SerializeToString()
            self._send(h, HTTPStatus.OK, payload, reply_type)
            return
        code = _GRPC_RESOURCE_EXHAUSTED if result.queue_full else _GRPC_UNAVAILABLE
        self.reply_error(h, HTTPStatus.SERVICE_UNAVAILABLE, result.message, reply_type, grpc_code=code)

    def _decompress(self, body: bytes, encoding: str) -> bytes:
        if encoding in ("", "identity"):
            return body
        if encoding not in ("gzip", "deflate"):
            raise MalformedRequest(f"Content-Encoding {encoding!r} not supported; use gzip, deflate or none")
        wbits = 16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS
        inflater = zlib.decompressobj(wbits)
        try:
            out = inflater.decompress(body, self._max_request_bytes + 1)
        except zlib.error as exc:
            raise MalformedRequest(f"body is not valid {encoding}: {exc}") from exc
        if len(out) > self._max_request_bytes:
            raise MalformedRequest(f"decompressed body exceeds the limit of {self._max_request_bytes} bytes")
        return out

    def _malformed(self, h: _Handler, status: HTTPStatus, message: str, reply_type: str) -> None:
        self._on_malformed()
        self.reply_error(h, status, message, reply_type)

    def reply_error(
        self, h: _Handler, status: HTTPStatus, message: str, reply_type: str, grpc_code: int = _GRPC_INVALID_ARGUMENT
    ) -> None:
        st = Status(code=grpc_code, message=message)
        body = json_format.MessageToJson(st, indent=None).encode() if reply_type == _JSON else st.SerializeToString()
        extra = {"Retry-After": str(self._retry_after_s)} if status == HTTPStatus.SERVICE_UNAVAILABLE else {}
        self._send(h, status, body, reply_type, extra)

    @staticmethod
    def _send(h: _Handler, status: HTTPStatus, body: bytes, content_type: str, extra: dict[str, str] | None = None) -> None:
        h.send_response(status)
        h.send_header("Content-Type", content_type)
        h.send_header("Content-Length", str(len(body)))
        for key, value in (extra or {}).items():
            h.send_header(key, value)
        if h.close_connection:
            h.send_header("Connection", "close")
        h.end_headers()
        h.wfile.write(body)

