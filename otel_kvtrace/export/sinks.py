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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Protocol
from urllib.parse import urlparse

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export import SpanExportResult

from otel_kvtrace.export.encode import (
    resource_json,
    resource_text,
    spans_to_readable_spans,
    spans_to_request,
    texts_to_json_line,
    texts_to_spans,
)

logger = logging.getLogger("otel_kvtrace")

TRACES_SUBDIR = "traces"


class SpanSink(Protocol):
    """One destination for exported spans. Called only from the exporter (one thread at a time)."""

    def export(self, span_texts: Sequence[str], dropped: int) -> bool:
        """Deliver one batch. Each text is one or more comma-separated OTLP/JSON span objects (one task's
        spans from ``SpanBuilder.build_json``, or single spans); ``dropped`` is the cumulative count of
        lost records. Returns False when the batch was lost."""
        ...

    def shutdown(self) -> None:
        """Release resources; abort any retry in progress. Idempotent."""
        ...


def trace_file_path(directory: str | os.PathLike[str], run_id: str, pid: int) -> Path:
    """``{directory}/traces/kvtrace-{run_id}-{pid}.jsonl`` (run id made safe for a file name)."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", run_id) or "run"
    return Path(directory) / TRACES_SUBDIR / f"kvtrace-{safe}-{pid}.jsonl"


class JsonLinesFileSink:
    """The embedded default: one OTLP/JSON ``ExportTraceServiceRequest`` per line, Collector file-exporter shape.

    The file is opened on first export (so an idle process leaves no file) and reopened under the new
    pid after a fork. Each line is written whole and flushed, so a reader never sees half a request.
    """

    def __init__(self, directory: str | os.PathLike[str], run_id: str, resource: Mapping[str, Any]) -> None:
        self.directory = Path(directory)
        self.run_id = run_id
        self._resource_attrs = dict(resource)
        self._resource = resource_text(resource)
        self._file: IO[bytes] | None = None
        self._pid = -1
        self.name_pid: int | None = None  # the exporter agent names the file after its serving process
        self.path = trace_file_path(self.directory, run_id, os.getpid())

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
        self.path = trace_file_path(self.directory, self.run_id, self.name_pid or pid)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "ab")  # noqa: SIM115 - lives as long as the sink
        self._pid = pid

    def shutdown(self) -> None:
        if self._file is not None and self._pid == os.getpid():
            self._file.close()
        self._file = None


class NullSink:
    """Discards spans (``OTEL_SDK_DISABLED=true``): the recorder is still drained, so memory stays flat."""

    def export(self, span_texts: Sequence[str], dropped: int) -> bool:
        return True

    def shutdown(self) -> None:
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

    def shutdown(self) -> None:
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

    def _make_exporter(self) -> Any:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        endpoint = self._endpoint_arg
        return OTLPSpanExporter(endpoint=http_traces_url(endpoint) if endpoint else None)

    def export(self, span_texts: Sequence[str], dropped: int) -> bool:
        exporter = self._current()
        if getattr(exporter, "_shutdown", False):
            return False
        spans = texts_to_spans(span_texts)
        # The SDK's HTTP client (retries, compression, headers) takes serialized bytes; older SDKs
        # lack it, and then the batch goes through the public ReadableSpan path instead.
        send_bytes = getattr(getattr(exporter, "_client", None), "export", None)
        if send_bytes is not None:
            data = spans_to_request(spans, self._resource, dropped).SerializeToString()
            return bool(send_bytes(data).success)
        from opentelemetry.sdk.resources import Resource

        readable = spans_to_readable_spans(spans, Resource(self._resource_attrs), dropped)
        return exporter.export(readable) == SpanExportResult.SUCCESS
