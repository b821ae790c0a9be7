"""OTLP/HTTP ``POST /v1/traces`` and ``POST /v1/metrics`` endpoint (``application/x-protobuf`` and
``application/json``).

Answers follow the OTLP/HTTP spec: 200 with an ``Export{Trace,Metrics}ServiceResponse`` in the request's encoding
once the request is written; 400 with a ``google.rpc.Status`` body for a body that is not an OTLP request;
503 with ``Retry-After`` when it cannot be written now (queue full, memory budget used, disk full,
stopping; the exporters retry on 503). Every request gets an answer and lands in one counter; a body
shorter than its ``Content-Length`` (the client went away) is counted and never written.

Decompression is streamed in 1 MiB steps, each reserved from the receiver's shared ``MemoryBudget``, and
stops at the per-request limit: a small body that inflates to gigabytes costs at most the limit, and many
at once cost at most the budget.
"""

from __future__ import annotations

import logging
import socket
import threading
import zlib
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from google.protobuf import json_format
from google.rpc.status_pb2 import Status

from otel_kvtrace.collect.queue import MemoryBudget
from otel_kvtrace.collect.stats import StatsCounter
from otel_kvtrace.collect.validate import SIGNALS, AcceptFn, MalformedRequest

PATHS = {signal.http_path: signal for signal in SIGNALS}
_PROTOBUF = "application/x-protobuf"
_JSON = "application/json"
_GRPC_INVALID_ARGUMENT = 3
_GRPC_RESOURCE_EXHAUSTED = 8
_GRPC_INTERNAL = 13
_GRPC_UNAVAILABLE = 14
_INFLATE_STEP = 1 << 20
_log = logging.getLogger(__name__)


class _Refused(Exception):
    """A request answered with ``status`` (and counted in ``counter``) before it reached the receiver."""

    def __init__(self, status: HTTPStatus, message: str, counter: str, grpc_code: int = _GRPC_INVALID_ARGUMENT):
        super().__init__(message)
        self.status, self.counter, self.grpc_code = status, counter, grpc_code


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # idle keep-alive connections must not hold the process at exit
    # SO_REUSEADDR: a restart binds at once even while connections of a killed receiver are in TIME_WAIT;
    # on Linux a port another socket listens on still fails to bind.
    allow_reuse_address = True
    request_queue_size = 128  # listen backlog: socketserver's 5 resets connections of a burst of workers

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
        self.close_connection = True  # a body, if any, is not read
        self.server.endpoint.count("malformed_http")
        self.server.endpoint.reply_error(self, HTTPStatus.METHOD_NOT_ALLOWED, "use POST /v1/traces or /v1/metrics",
                                         _JSON)

    do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = do_GET

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own answers (bad request line, unknown method: 400/414/431/501) are counted too."""
        self.server.endpoint.count("malformed_http")
        super().send_error(code, message, explain)


class HttpEndpoint:
    """A threading HTTP server bound to ``host:port`` (port 0 picks a free port)."""

    def __init__(
        self,
        host: str,
        port: int,
        accept: AcceptFn,
        on_malformed: Callable[[], None],
        max_request_bytes: int,
        memory: MemoryBudget,
        stats: StatsCounter,
        retry_after_s: int = 1,
    ) -> None:
        self._accept = accept
        self._on_malformed = on_malformed
        self._max_request_bytes = max_request_bytes
        self._memory = memory
        self._stats = stats
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

    def count(self, counter: str) -> None:
        self._stats.add(**{counter: 1})

    def handle_post(self, h: _Handler) -> None:
        with self._cond:
            self._inflight += 1
        reserved = [0]  # bytes of the shared memory budget this request holds
        try:
            self._handle_post(h, reserved)
        except _Refused as exc:
            self.count(exc.counter)
            if exc.counter != "truncated_http":  # nobody is left to read an answer
                self.reply_error(h, exc.status, str(exc), self._reply_type(h), grpc_code=exc.grpc_code)
        except (ConnectionError, TimeoutError):
            self.count("truncated_http")
            h.close_connection = True
        except Exception:  # noqa: BLE001 - a bug must cost one request an answer of 500, never the server
            _log.exception("kvtrace collect: unexpected error handling an HTTP request")
            self.count("internal_errors")
            h.close_connection = True
            try:
                self.reply_error(h, HTTPStatus.INTERNAL_SERVER_ERROR, "internal error in kvtrace collect",
                                 self._reply_type(h), grpc_code=_GRPC_INTERNAL)
            except OSError:
                pass
        finally:
            self._memory.release(reserved[0])
            with self._cond:
                self._inflight -= 1
                self._cond.notify_all()

    @staticmethod
    def _reply_type(h: _Handler) -> str:
        content_type = (h.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        return _JSON if content_type == _JSON else _PROTOBUF

    def _reserve(self, reserved: list[int], n: int) -> None:
        if not self._memory.try_reserve(n):
            raise _Refused(HTTPStatus.SERVICE_UNAVAILABLE, "receiver memory budget in use by other requests; retry",
                           "refused_memory", grpc_code=_GRPC_RESOURCE_EXHAUSTED)
        reserved[0] += n

    def _read_body(self, h: _Handler, length: int, reserved: list[int]) -> bytes:
        keep = h.close_connection
        h.close_connection = True  # until the body is read: a refusal here leaves it unread on the socket
        self._reserve(reserved, length)
        h.close_connection = keep
        body = h.rfile.read(length)
        if len(body) != length:  # the client closed the connection part-way
            h.close_connection = True
            raise _Refused(HTTPStatus.BAD_REQUEST, f"body ended after {len(body)} of {length} bytes",
                           "truncated_http")
        return body

    def _handle_post(self, h: _Handler, reserved: list[int]) -> None:
        content_type = (h.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        reply_type = self._reply_type(h)
        length_header = h.headers.get("Content-Length")
        if length_header is None or not (length_header.isascii() and length_header.isdigit()):
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
        if h.headers.get("Transfer-Encoding"):
            h.close_connection = True
            self._malformed(h, HTTPStatus.BAD_REQUEST, "Transfer-Encoding is not supported; send Content-Length",
                            reply_type)
            return
        # read even when refusing, so a keep-alive connection stays in sync
        body = self._read_body(h, length, reserved)
        signal = PATHS.get(h.path.split("?")[0])
        if signal is None:
            message = f"unknown path {h.path!r}; OTLP traces go to /v1/traces, metrics to /v1/metrics"
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
            body = self._decompress(body, (h.headers.get("Content-Encoding") or "").strip().lower(), reserved)
            req = signal.decode_json(body) if content_type == _JSON else signal.decode_protobuf(body)
        except MalformedRequest as exc:
            self._malformed(h, HTTPStatus.BAD_REQUEST, str(exc), reply_type)
            return
        result = self._accept(signal, req, len(body))
        if result.response is not None:
            if reply_type == _JSON:
                payload = json_format.MessageToJson(result.response, indent=None).encode()
            else:
                payload = result.response.SerializeToString()
            self._send(h, HTTPStatus.OK, payload, reply_type)
            return
        if result.too_large:
            self.reply_error(h, HTTPStatus.REQUEST_ENTITY_TOO_LARGE, result.message, reply_type)
            return
        code = _GRPC_RESOURCE_EXHAUSTED if result.queue_full else _GRPC_UNAVAILABLE
        self.reply_error(h, HTTPStatus.SERVICE_UNAVAILABLE, result.message, reply_type, grpc_code=code)

    def _decompress(self, body: bytes, encoding: str, reserved: list[int]) -> bytes:
        """Inflate in steps reserved from the memory budget; stop at the per-request limit."""
        if encoding in ("", "identity"):
            return body
        if encoding not in ("gzip", "deflate"):
            raise MalformedRequest(f"Content-Encoding {encoding!r} not supported; use gzip, deflate or none")
        wbits = 16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS
        inflater = zlib.decompressobj(wbits)
        parts: list[bytes] = []
        size = 0
        pending = body
        try:
            while True:
                self._reserve(reserved, _INFLATE_STEP)
                chunk = inflater.decompress(pending, _INFLATE_STEP)
                pending = inflater.unconsumed_tail
                size += len(chunk)
                if size > self._max_request_bytes:
                    raise _Refused(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                                   f"decompressed body exceeds the limit of {self._max_request_bytes} bytes",
                                   "malformed_http")
                parts.append(chunk)
                if inflater.eof or (not pending and not chunk):
                    break
        except zlib.error as exc:
            raise MalformedRequest(f"body is not valid {encoding}: {exc}") from exc
        if not inflater.eof:
            raise MalformedRequest(f"body is not valid {encoding}: truncated stream")
        return b"".join(parts)

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

