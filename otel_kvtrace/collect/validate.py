"""Decode and check incoming OTLP trace requests (the part both protocols share)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from otel_kvtrace.export.otlp_json import json_line_to_request


@dataclass(slots=True)
class AcceptResult:
    """What the receiver did with a decoded request: ``response`` once written, else why it was refused.

    ``queue_full`` / ``too_large`` pick the refusal's status; any other refusal is "unavailable, retry"."""

    response: ExportTraceServiceResponse | None
    queue_full: bool = False
    message: str = ""
    too_large: bool = False


AcceptFn = Callable[[ExportTraceServiceRequest, int], AcceptResult]
"""(request, wire size in bytes) -> result; implemented by the receiver, called by both endpoints."""


class MalformedRequest(ValueError):
    """The request body is not an OTLP trace export request."""


def decode_protobuf(body: bytes) -> ExportTraceServiceRequest:
    """Parse a binary ``ExportTraceServiceRequest``; raise ``MalformedRequest`` if it does not decode."""
    try:
        return ExportTraceServiceRequest.FromString(body)
    except DecodeError as exc:
        raise MalformedRequest(f"protobuf body does not decode as ExportTraceServiceRequest: {exc}") from exc


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
