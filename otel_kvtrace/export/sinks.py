"""Where exported spans go: a local OTLP/JSON lines file, OTLP/gRPC, OTLP/HTTP (protobuf), or nowhere.

Every sink takes one batch of tasks, each task's spans as OTLP/JSON text
(``SpanBuilder.build_json``), and returns whether the batch was delivered. The network sinks send
through the OpenTelemetry SDK's own OTLP exporters, so endpoint, headers, TLS, compression, timeout
and retry settings come from the standard ``OTEL_EXPORTER_OTLP_*`` variables exactly as for any OTel
application; only the request is built by us (protobuf messages built directly: about 3x cheaper than
SDK ``ReadableSpan`` + the SDK encoder, see ``docs/export.md``).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import IO, Any, Protocol
from urllib.parse import urlparse

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export import SpanExportResult

from otel_kvtrace.export.encode import (
    resource_json,
    resource_text,
    spans_to_request,
    texts_to_json_line,
    texts_to_spans,
)

logger = logging.getLogger("otel_kvtrace")

TRACES_SUBDIR = "traces"
HTTP_POST_THREAD_NAME = "kvtrace-http-post"


class SpanSink(Protocol):
    """One destination for exported spans. Called only from the exporter (one thread at a time)."""

    def export(self, span_texts: Sequence[str], dropped: int) -> bool:
        """Deliver one batch. Each text is one or more comma-separated OTLP/JSON span objects (one task's
        spans from ``SpanBuilder.build_json``, or single spans); ``dropped`` is the cumulative count of
        lost records. Returns False when the batch was lost."""
        ...

    def shutdown(self, timeout_s: float | None = None) -> None:
        """Release resources; a sink that holds undelivered batches may keep sending up to ``timeout_s``.
        Idempotent."""
        ...


def safe_run_id(run_id: str) -> str:
    """The run id as one file-name component: only ``[A-Za-z0-9._-]``, never ``.``/``..`` alone."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", run_id).strip(".") or "run"
    return safe


def trace_file_path(directory: str | os.PathLike[str], run_id: str, pid: int) -> Path:
    """``{directory}/traces/kvtrace-{run_id}-{pid}.jsonl`` (run id made safe for a file name)."""
    return Path(directory) / TRACES_SUBDIR / f"kvtrace-{safe_run_id(run_id)}-{pid}.jsonl"


class JsonLinesFileSink:
    """The embedded default: one OTLP/JSON ``ExportTraceServiceRequest`` per line, Collector file-exporter shape.

    The file is opened on first export (so an idle process leaves no file) and reopened under the new
    pid after a fork. Each line is written whole and flushed, so a reader never sees half a request.
    """

    def __init__(self, directory: str | os.PathLike[str], run_id: str, resource: Mapping[str, Any], *,
                 path_for_pid: Callable[[int], Path] | None = None) -> None:
        self.directory = Path(directory)
        self.run_id = run_id
        # another file name per pid (asynccheck's ``kvtrace-async-*``); default ``trace_file_path``
        self._path_for_pid = path_for_pid or (lambda pid: trace_file_path(self.directory, run_id, pid))
        self._resource_attrs = dict(resource)
        self._resource = resource_text(resource)
        self._file: IO[bytes] | None = None
        self._pid = -1
        self.name_pid: int | None = None  # the exporter agent names the file after its serving process
        self.path = self._path_for_pid(os.getpid())

    def update_resource(self, attributes: Mapping[str, Any]) -> None:
        """Add attributes (e.g. a worker's config and ranks, known only once it starts) to later lines."""
        self._resource_attrs = {**self._resource_attrs, **attributes}
        self._resource = resource_text(self._resource_attrs)  # one reference swap: atomic for readers

    def export(self, span_texts: Sequence[str], dropped: int) -> bool:
        line = texts_to_json_line(span_texts, self._resource, dropped)
        pid = os.getpid()
        if self._file is None or pid != self._pid:
            self._open(pid)
        assert self._file is not None
        self._file.write(line)
        self._file.flush()
        return True

    def _open(self, pid: int) -> None:
        if self._file is not None and pid == self._pid:
            return
        self._file = None  # after a fork the parent's handle is not ours to close
        self.path = self._path_for_pid(self.name_pid or pid)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "ab")  # noqa: SIM115 - lives as long as the sink
        self._pid = pid

    def shutdown(self, timeout_s: float | None = None) -> None:
        if self._file is not None and self._pid == os.getpid():
            self._file.close()
        self._file = None


class NullSink:
    """Discards spans (``OTEL_SDK_DISABLED=true``): the recorder is still drained, so memory stays flat."""

    def export(self, span_texts: Sequence[str], dropped: int) -> bool:
        return True

    def shutdown(self, timeout_s: float | None = None) -> None:
        return None


# ---- one delivery attempt (the policy around it: export/delivery.py) -----------------------------
OK = "ok"
RETRY = "retry"  # transient: back off and send the same request again
TOO_LARGE = "too_large"  # the receiver's message limit: split and send the halves
REJECTED = "rejected"  # permanent: the receiver refuses this request (kept on disk, not retried)


@dataclass(slots=True, frozen=True)
class Attempt:
    """The outcome of sending one request once; ``delay`` is the receiver's own retry hint, if any.

    An ``OK`` with ``rejected_spans`` is an OTLP partial success: the receiver took the request but
    dropped that many of its spans (``detail`` is its ``error_message``)."""

    outcome: str
    detail: str = ""
    delay: float | None = None
    rejected_spans: int = 0


def accepted(response: Any) -> Attempt:
    """``OK``, with the ``partial_success`` of an ``ExportTraceServiceResponse`` (OTLP spec) when spans
    were rejected."""
    partial = getattr(response, "partial_success", None)
    rejected = int(getattr(partial, "rejected_spans", 0) or 0)
    if rejected <= 0:
        return Attempt(OK)
    return Attempt(OK, str(getattr(partial, "error_message", "") or "no reason given"), rejected_spans=rejected)


def _http_response(body: bytes) -> Attempt:
    """A 2xx body: an ``ExportTraceServiceResponse`` (protobuf; empty = full success)."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

    try:
        return accepted(ExportTraceServiceResponse.FromString(body or b""))
    except Exception:  # noqa: BLE001 - a 2xx with a body we cannot read: the spec says success
        return Attempt(OK)


#: gRPC codes worth retrying (OTLP spec), plus RESOURCE_EXHAUSTED: a Collector's memory limiter sends it.
GRPC_RETRYABLE = frozenset(
    {"CANCELLED", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "ABORTED", "OUT_OF_RANGE", "UNAVAILABLE", "DATA_LOSS"}
)
HTTP_RETRYABLE = frozenset({429, 502, 503, 504})


def retry_after_seconds(value: str | None) -> float | None:
    """An HTTP ``Retry-After`` value (seconds or an HTTP date, RFC 9110) as seconds from now."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def _grpc_retry_delay(error: Any) -> float | None:
    """The server's ``google.rpc.RetryInfo`` delay (the trailer the SDK exporter reads), if sent."""
    try:
        raw = dict(error.trailing_metadata() or ()).get("google.rpc.retryinfo-bin")
        if raw is None:
            return None
        from google.rpc.error_details_pb2 import RetryInfo

        info = RetryInfo.FromString(raw)
        return info.retry_delay.seconds + info.retry_delay.nanos / 1e9
    except Exception:  # noqa: BLE001 - a malformed hint: use our own back-off
        return None


def _span_count(request: ExportTraceServiceRequest) -> int:
    return sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)


def _make_grpc_exporter(**kwargs: Any) -> Any:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    class RequestGrpcExporter(OTLPSpanExporter):
        """The SDK gRPC exporter, fed ready-made ``ExportTraceServiceRequest``s (retries, env config kept)."""

        def _translate_data(self, data: Any) -> ExportTraceServiceRequest:  # type: ignore[override]
            return data if isinstance(data, ExportTraceServiceRequest) else super()._translate_data(data)

        def _count_data(self, data: Any) -> int:  # type: ignore[override]
            return _span_count(data) if isinstance(data, ExportTraceServiceRequest) else len(data)

    return RequestGrpcExporter(**kwargs)


class _SdkExporterSink:
    """Holds one SDK exporter per process: after a fork the child builds its own (gRPC channels and
    HTTP connection pools must not be shared across a fork)."""

    protocol = ""

    def __init__(self, resource: Mapping[str, Any], endpoint: str | None) -> None:
        self._endpoint_arg = endpoint
        self._resource_attrs = dict(resource)
        self._resource = resource_json(resource)
        self._pid = os.getpid()
        self._exporter = self._make_exporter()
        self.endpoint = getattr(self._exporter, "_endpoint", endpoint)

    def update_resource(self, attributes: Mapping[str, Any]) -> None:
        """Add attributes to the resource of later requests."""
        self._resource_attrs = {**self._resource_attrs, **attributes}
        self._resource = resource_json(self._resource_attrs)

    def _make_exporter(self) -> Any:
        raise NotImplementedError

    def _current(self) -> Any:
        pid = os.getpid()
        if pid != self._pid:
            self._pid = pid
            self._exporter = self._make_exporter()
        return self._exporter

    @property
    def endpoint_url(self) -> str:
        """The endpoint as a URL another process can be pointed at (``kvtrace resend --endpoint``)."""
        if self.protocol == "grpc":
            insecure = getattr(self._exporter, "_insecure", True)
            return f"{'http' if insecure else 'https'}://{self.endpoint}"
        return str(self.endpoint)

    def shutdown(self, timeout_s: float | None = None) -> None:
        if os.getpid() == self._pid and not getattr(self._exporter, "_shutdown", False):
            self._exporter.shutdown()


class OtlpGrpcSink(_SdkExporterSink):
    """OTLP/gRPC through the SDK's ``OTLPSpanExporter`` (``OTEL_EXPORTER_OTLP_*`` settings apply)."""

    protocol = "grpc"

    def _make_exporter(self) -> Any:
        return _make_grpc_exporter(**({"endpoint": self._endpoint_arg} if self._endpoint_arg else {}))

    def export(self, span_texts: Sequence[str], dropped: int) -> bool:
        exporter = self._current()
        request = spans_to_request(texts_to_spans(span_texts), self._resource, dropped)
        return exporter.export(request) == SpanExportResult.SUCCESS

    def attempt(self, request: ExportTraceServiceRequest, abort: threading.Event) -> Attempt:
        """Send once (no SDK retry loop), through the SDK exporter's channel, headers and timeout."""
        import grpc

        exporter = self._current()
        client = getattr(exporter, "_client", None)
        if client is None:  # an SDK without the stub: its own export (with its own retries)
            return Attempt(OK) if exporter.export(request) == SpanExportResult.SUCCESS else Attempt(RETRY, "failed")
        call = client.Export.future(request, metadata=exporter._headers, timeout=exporter._timeout)
        done = threading.Event()
        call.add_done_callback(lambda _call: done.set())
        while not done.wait(0.05):
            if abort.is_set():
                call.cancel()
                return Attempt(RETRY, "aborted at shutdown")
        try:
            return accepted(call.result())
        except grpc.RpcError as error:
            code = error.code()
            name = getattr(code, "name", str(code))
            detail = f"{name}: {error.details()}"
            if name == "UNAVAILABLE":
                _reconnect(exporter)
            if name == "RESOURCE_EXHAUSTED" and "larger than max" in (error.details() or "").lower():
                return Attempt(TOO_LARGE, detail)
            if name in GRPC_RETRYABLE:
                return Attempt(RETRY, detail, _grpc_retry_delay(error))
            return Attempt(REJECTED, detail)


def _reconnect(exporter: Any) -> None:
    """Close the channel and open a new one now, not after gRPC's own back-off (what the SDK exporter
    does on UNAVAILABLE). An SDK without ``_initialize_channel_and_stub`` (< 1.40) keeps its channel,
    which reconnects by itself."""
    reinit = getattr(exporter, "_initialize_channel_and_stub", None)
    if reinit is None:
        return
    try:
        channel = getattr(exporter, "_channel", None)
        if channel is not None:
            channel.close()
        reinit()
    except Exception as exc:  # noqa: BLE001 - the next attempt fails and is retried
        logger.debug("otel-kvtrace: gRPC reconnect failed: %r", exc)


#: The first release whose HTTP exporter has ``_client._submit`` / ``_client._compress`` (one POST, no
#: SDK retry loop) that ``OtlpHttpSink.attempt`` sends through; ``pyproject.toml`` requires it.
MIN_HTTP_EXPORTER = "1.45.0"


def http_traces_url(endpoint: str) -> str:
    """A base endpoint (``http://host:4318``) plus ``/v1/traces``; a URL with a path is kept as is."""
    parsed = urlparse(endpoint)
    if parsed.path in ("", "/"):
        return endpoint.rstrip("/") + "/v1/traces"
    return endpoint


class OtlpHttpSink(_SdkExporterSink):
    """OTLP/HTTP (protobuf) through the SDK's ``OTLPSpanExporter`` (``OTEL_EXPORTER_OTLP_*`` settings apply).

    ``endpoint`` is a base URL like ``OTEL_EXPORTER_OTLP_ENDPOINT`` (``/v1/traces`` is appended when it
    has no path); ``None`` lets the SDK resolve the traces URL from the environment.
    """

    protocol = "http/protobuf"

    def _make_sdk_exporter(self) -> Any:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        endpoint = self._endpoint_arg
        return OTLPSpanExporter(endpoint=http_traces_url(endpoint) if endpoint else None)

    def export(self, span_texts: Sequence[str], dropped: int) -> bool:
        exporter = self._current()
        if getattr(exporter, "_shutdown", False):
            return False
        # The SDK's HTTP client (retries, compression, headers) takes serialized bytes.
        data = spans_to_request(texts_to_spans(span_texts), self._resource, dropped).SerializeToString()
        return bool(exporter._client.export(data).success)

    def _make_exporter(self) -> Any:
        exporter = self._make_sdk_exporter()
        client = getattr(exporter, "_client", None)
        if not all(callable(getattr(client, name, None)) for name in ("_submit", "_compress")):
            raise RuntimeError(f"OTLP/HTTP delivery needs opentelemetry-exporter-otlp-proto-http>={MIN_HTTP_EXPORTER} "
                               f"(its exporter has no _client._submit/_compress: {type(exporter).__module__})")
        return exporter

    def attempt(self, request: ExportTraceServiceRequest, abort: threading.Event) -> Attempt:
        """POST once (no SDK retry loop) with the SDK client's URL, headers, compression and timeout.

        The POST runs on a helper thread so that ``abort`` (shutdown, the exit drain's deadline) ends the
        wait within 50 ms, as it does a gRPC call: a receiver that never answers must not hold the sender
        for the client's whole timeout. The batch stays in the spool either way."""
        client = self._current()._client
        data = client._compress(request.SerializeToString())
        outcome: list[Any] = []

        def post() -> None:
            try:
                outcome.append(client._submit(data, client._timeout))
            except BaseException as exc:  # noqa: BLE001 - re-raised on the sender's thread below
                outcome.append(exc)

        poster = threading.Thread(target=post, name=HTTP_POST_THREAD_NAME, daemon=True)
        poster.start()
        while poster.is_alive():
            poster.join(0.05)
            if abort.is_set() and poster.is_alive():
                return Attempt(RETRY, "aborted at shutdown")
        result = outcome[0]
        if isinstance(result, BaseException):
            raise result
        status = result.status_code
        if result.error is None and status is not None and 200 <= status < 300:
            try:
                body = result.content()
            except Exception:  # noqa: BLE001 - no readable body: a plain success
                body = b""
            return _http_response(body)
        if status is None:  # refused, reset, timed out: the endpoint is not answering
            return Attempt(RETRY, f"{type(result.error).__name__}: {result.error}")
        detail = f"HTTP {status}"
        if status == 413:
            return Attempt(TOO_LARGE, detail)
        if status in HTTP_RETRYABLE:
            try:
                hint = retry_after_seconds(result.headers().get("retry-after"))
            except Exception:  # noqa: BLE001
                hint = None
            return Attempt(RETRY, detail, hint)
        return Attempt(REJECTED, detail)
