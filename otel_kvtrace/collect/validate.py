"""Decode and check incoming OTLP requests (the part both protocols share), per signal: traces, metrics."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from otel_kvtrace.export.otlp_json import json_line_to_request, request_to_json_line


@dataclass(slots=True)
class AcceptResult:
    """What the receiver did with a decoded request: ``response`` once written, else why it was refused.

    ``queue_full`` / ``too_large`` pick the refusal's status; any other refusal is "unavailable, retry"."""

    response: Message | None
    queue_full: bool = False
    message: str = ""
    too_large: bool = False


class MalformedRequest(ValueError):
    """The request body is not an OTLP export request of the signal it was sent to."""


@dataclass(frozen=True, slots=True)
class Signal:
    """One OTLP signal the receiver takes: where it arrives (gRPC service, HTTP path) and how it is
    decoded, counted (``items``: spans or data points), trimmed of invalid items and written as a line."""

    name: str
    grpc_service: str
    http_path: str
    request_type: type[Any]
    decode_json: Callable[[bytes], Any]
    to_line: Callable[[Any], bytes]
    items: Callable[[Any], int]
    drop_invalid: Callable[[Any], int]
    response: Callable[[int], Message]

    def decode_protobuf(self, body: bytes) -> Any:
        """Parse a binary export request of this signal; raise ``MalformedRequest`` if it does not decode."""
        try:
            return self.request_type.FromString(body)
        except DecodeError as exc:
            raise MalformedRequest(
                f"protobuf body does not decode as {self.request_type.__name__}: {exc}") from exc


AcceptFn = Callable[[Signal, Any, int], AcceptResult]
"""(signal, request, wire size in bytes) -> result; implemented by the receiver, called by both endpoints."""


def decode_json(body: bytes) -> ExportTraceServiceRequest:
    """Parse an OTLP/JSON request body (hex ids, as OTLP/HTTP JSON requires)."""
    try:
        return json_line_to_request(body)
    except (ValueError, TypeError, AttributeError, KeyError, RecursionError) as exc:
        # a JSON value of the wrong shape (a list where an object belongs, ...) fails inside the codec
        raise MalformedRequest(f"not an OTLP/JSON trace request: {type(exc).__name__}: {exc}") from exc


def drop_invalid_spans(req: ExportTraceServiceRequest) -> int:
    """Remove spans whose ids have the wrong length (trace 16 bytes, span 8, parent 0 or 8); return how many.

    Such spans cannot be correlated or loaded; OTLP lets a receiver reject them and report a partial success.
    """
    rejected = 0
    for rs in req.resource_spans:
        for ss in rs.scope_spans:
            bad = [
                i
                for i, span in enumerate(ss.spans)
                if len(span.trace_id) != 16
                or len(span.span_id) != 8
                or len(span.parent_span_id) not in (0, 8)
            ]
            for i in reversed(bad):
                del ss.spans[i]
            rejected += len(bad)
    return rejected


def count_spans(req: ExportTraceServiceRequest) -> int:
    """Number of spans in ``req``."""
    return sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)


def export_response(rejected: int) -> ExportTraceServiceResponse:
    """The success response, with ``partial_success`` filled when spans were rejected."""
    resp = ExportTraceServiceResponse()
    if rejected:
        resp.partial_success.rejected_spans = rejected
        resp.partial_success.error_message = "spans with invalid trace_id/span_id length were dropped"
    return resp


def decode_metrics_json(body: bytes) -> ExportMetricsServiceRequest:
    """Parse an OTLP/JSON metrics request body (unknown fields ignored, as OTLP receivers must)."""
    try:
        doc = orjson.loads(body)
        if not isinstance(doc, dict):
            raise TypeError("an OTLP/JSON metrics request is a JSON object with 'resourceMetrics'")
        return json_format.ParseDict(doc, ExportMetricsServiceRequest(), ignore_unknown_fields=True)
    except (orjson.JSONDecodeError, json_format.ParseError, TypeError, ValueError, RecursionError) as exc:
        raise MalformedRequest(f"not an OTLP/JSON metrics request: {type(exc).__name__}: {exc}") from exc


def metrics_to_json_line(req: ExportMetricsServiceRequest) -> bytes:
    """One OTLP/JSON line, the shape ``otel_kvtrace.resources`` reads (and its no-endpoint exporter writes)."""
    return orjson.dumps(json_format.MessageToDict(req, use_integers_for_enums=True)) + b"\n"


_POINT_FIELDS = ("gauge", "sum", "histogram", "exponential_histogram", "summary")


def count_points(req: ExportMetricsServiceRequest) -> int:
    """Number of data points in ``req`` (of every metric type)."""
    n = 0
    for rm in req.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                kind = metric.WhichOneof("data")
                n += len(getattr(metric, kind).data_points) if kind in _POINT_FIELDS else 0
    return n


def metrics_response(rejected: int) -> ExportMetricsServiceResponse:
    """The success response of a metrics export (nothing is rejected: a metric without points is kept as is)."""
    return ExportMetricsServiceResponse()


TRACES = Signal(
    name="traces", grpc_service="opentelemetry.proto.collector.trace.v1.TraceService", http_path="/v1/traces",
    request_type=ExportTraceServiceRequest, decode_json=decode_json, to_line=request_to_json_line,
    items=count_spans, drop_invalid=drop_invalid_spans, response=export_response)
METRICS = Signal(
    name="metrics", grpc_service="opentelemetry.proto.collector.metrics.v1.MetricsService",
    http_path="/v1/metrics", request_type=ExportMetricsServiceRequest, decode_json=decode_metrics_json,
    to_line=metrics_to_json_line, items=count_points, drop_invalid=lambda req: 0, response=metrics_response)
SIGNALS = (TRACES, METRICS)
