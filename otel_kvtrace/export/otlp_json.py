"""OTLP/JSON codec for trace requests, in the shape the OpenTelemetry Collector's file exporter writes.

One ``ExportTraceServiceRequest`` per line; lowerCamelCase keys; trace/span ids as lowercase hex (the
OTLP/JSON rule, where protobuf's canonical JSON would use base64); int64/fixed64 as decimal strings; enums
as ints. ``google.protobuf.json_format`` does everything except the id encoding, which is patched on the
dict in both directions.
"""

from __future__ import annotations

import base64
from typing import Any

import orjson
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

_SPAN_ID_KEYS = ("traceId", "spanId", "parentSpanId")

MAX_LINE_BYTES = 256 * 1024 * 1024
"""Longest OTLP/JSON line the loader reads (DuckDB ``maximum_object_size``); ``kvtrace collect`` refuses a
request whose line would be longer, so everything it acknowledges can be loaded."""


def request_to_json_line(req: ExportTraceServiceRequest) -> bytes:
    """One OTLP/JSON line (ending in ``\\n``) for ``req``."""
    doc = json_format.MessageToDict(req, use_integers_for_enums=True)
    _convert_ids(doc, _b64_to_hex)
    return orjson.dumps(doc) + b"\n"


def json_line_to_request(line: bytes | str) -> ExportTraceServiceRequest:
    """Parse one OTLP/JSON line (as written by the Collector's file exporter or by this package).

    Unknown fields are ignored, as OTLP receivers must. Raises ``ValueError`` on malformed input.
    """
    try:
        doc = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"not a JSON line: {exc}") from exc
    if not isinstance(doc, dict):
        raise ValueError("OTLP/JSON line must be a JSON object with 'resourceSpans'")
    _convert_ids(doc, _hex_to_b64)
    req = ExportTraceServiceRequest()
    try:
        json_format.ParseDict(doc, req, ignore_unknown_fields=True)
    except json_format.ParseError as exc:
        raise ValueError(f"not an OTLP/JSON trace request: {exc}") from exc
    return req


def _convert_ids(doc: dict[str, Any], convert: Any) -> None:
    for rs in doc.get("resourceSpans") or ():
        for ss in rs.get("scopeSpans") or ():
            for span in ss.get("spans") or ():
                _convert_keys(span, convert)
                for link in span.get("links") or ():
                    _convert_keys(link, convert)


def _convert_keys(obj: dict[str, Any], convert: Any) -> None:
    for key in _SPAN_ID_KEYS:
        value = obj.get(key)
        if value:
            obj[key] = convert(value, key)


def _b64_to_hex(value: str, key: str) -> str:
    return base64.b64decode(value).hex()


def _hex_to_b64(value: str, key: str) -> str:
    try:
        raw = bytes.fromhex(value)
    except ValueError as exc:
        raise ValueError(f"{key} must be hex, got {value!r}") from exc
    return base64.b64encode(raw).decode("ascii")
