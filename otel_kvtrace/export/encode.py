"""OTLP/JSON spans -> wire formats: one JSON line, a protobuf request, or SDK ``ReadableSpan``s.

``export/spans.py`` writes each task's spans as OTLP/JSON text. The file sink wraps a batch of them
into one request line; the OTLP network sinks parse them (``orjson``) and convert them to protobuf
here. The third form
(SDK ``ReadableSpan`` + the SDK's own encoder) is kept because ``bench/export.py`` measures it as the
reference candidate; see ``docs/export.md`` for the numbers behind the choice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from otel_kvtrace.export.spans import SPAN_KIND_INTERNAL, STATUS_CODE_ERROR, JsonSpan, any_attr, int_attr

SCOPE_NAME = "otel_kvtrace"
DROPPED_SCOPE_ATTRIBUTE = "kvtrace.exporter.dropped"


def _scope_version() -> str:
    try:
        from importlib.metadata import version

        return version("otel-kvtrace")
    except Exception:  # noqa: BLE001 - not installed as a distribution (e.g. a bare source tree)
        return "0"


SCOPE_VERSION = _scope_version()


def resource_json(attributes: Mapping[str, Any]) -> list[dict[str, Any]]:
    """OTLP/JSON attribute list of a resource (computed once per sink)."""
    return [any_attr(key, value) for key, value in attributes.items()]


def spans_to_json_request(spans: Sequence[JsonSpan], resource: list[dict[str, Any]], dropped: int) -> dict[str, Any]:
    """The OTLP/JSON ``ExportTraceServiceRequest`` object holding ``spans``.

    ``dropped`` (cumulative records lost so far) goes into the scope attribute ``kvtrace.exporter.dropped``.
    """
    return {
        "resourceSpans": [
            {
                "resource": {"attributes": resource},
                "scopeSpans": [
                    {
                        "scope": {
                            "name": SCOPE_NAME,
                            "version": SCOPE_VERSION,
                            "attributes": [int_attr(DROPPED_SCOPE_ATTRIBUTE, dropped)],
                        },
                        "spans": spans,
                    }
                ],
            }
        ]
    }


def spans_to_json_line(spans: Sequence[JsonSpan], resource: list[dict[str, Any]], dropped: int) -> bytes:
    """One OTLP/JSON line (ending in ``\\n``) from span dicts: the file exporter's format."""
    return orjson.dumps(spans_to_json_request(spans, resource, dropped)) + b"\n"


def resource_text(attributes: Mapping[str, Any]) -> str:
    """The resource attribute list as OTLP/JSON text (computed once per sink)."""
    return orjson.dumps(resource_json(attributes)).decode()


def texts_to_json_line(span_texts: Sequence[str], resource: str, dropped: int) -> bytes:
    """One OTLP/JSON line from ``SpanBuilder.build_json`` texts (one per task): the file sink's format.

    Same document as ``spans_to_json_line`` over the parsed spans, without building any dicts.
    """
    scope = (
        f'{{"name":"{SCOPE_NAME}","version":{orjson.dumps(SCOPE_VERSION).decode()},'
        f'"attributes":[{{"key":"{DROPPED_SCOPE_ATTRIBUTE}","value":{{"intValue":"{dropped}"}}}}]}}'
    )
    spans = ",".join(span_texts)
    return (
        f'{{"resourceSpans":[{{"resource":{{"attributes":{resource}}},"scopeSpans":[{{"scope":{scope},'
        f'"spans":[{spans}]}}]}}]}}\n'
    ).encode()


def texts_to_spans(span_texts: Sequence[str]) -> list[JsonSpan]:
    """Parse ``SpanBuilder.build_json`` texts into span dicts (for the protobuf encoder)."""
    return orjson.loads(f"[{','.join(span_texts)}]")


# ---- protobuf -----------------------------------------------------------------------------------
def _fill_value(target: AnyValue, value: Mapping[str, Any]) -> None:
    for kind, v in value.items():  # exactly one entry
        if kind == "stringValue":
            target.string_value = v
        elif kind == "intValue":
            target.int_value = int(v)
        elif kind == "boolValue":
            target.bool_value = v
        elif kind == "doubleValue":
            target.double_value = v
        elif kind == "arrayValue":
            values = target.array_value.values
            for item in v.get("values", ()):
                _fill_value(values.add(), item)
            if not v.get("values"):
                target.array_value.SetInParent()
        elif kind == "bytesValue":
            import base64

            target.bytes_value = base64.b64decode(v)
        else:
            raise ValueError(f"unsupported OTLP/JSON value kind {kind!r}")


def _fill_attributes(target: Any, attrs: Sequence[Mapping[str, Any]]) -> None:
    for attr in attrs:
        kv: KeyValue = target.add()
        kv.key = attr["key"]
        _fill_value(kv.value, attr["value"])


def spans_to_request(
    spans: Sequence[JsonSpan], resource: list[dict[str, Any]], dropped: int
) -> ExportTraceServiceRequest:
    """The protobuf ``ExportTraceServiceRequest`` equal to ``spans_to_json_request(...)``.

    Hand-converted (``.add()`` on repeated fields, the cheapest upb path); ``json_format.ParseDict``
    gives the same message but costs several times more.
    """
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    _fill_attributes(rs.resource.attributes, resource)
    ss = rs.scope_spans.add()
    ss.scope.name = SCOPE_NAME
    ss.scope.version = SCOPE_VERSION
    _fill_attributes(ss.scope.attributes, [int_attr(DROPPED_SCOPE_ATTRIBUTE, dropped)])
    _fill_spans(ss.spans, spans)
    return req


def line_to_request(line: bytes | str) -> ExportTraceServiceRequest:
    """One of our own OTLP/JSON lines (file sink, delivery spool) -> the protobuf request, the fast way.

    Same converter as ``spans_to_request``, for every resource and scope of the line; the generic
    ``otlp_json.json_line_to_request`` (``json_format``) reads any Collector line but costs several times more.
    """
    doc = orjson.loads(line)
    req = ExportTraceServiceRequest()
    for rs_doc in doc.get("resourceSpans", ()):
        rs = req.resource_spans.add()
        _fill_attributes(rs.resource.attributes, rs_doc.get("resource", {}).get("attributes", ()))
        for ss_doc in rs_doc.get("scopeSpans", ()):
            ss = rs.scope_spans.add()
            scope = ss_doc.get("scope", {})
            ss.scope.name = scope.get("name", "")
            ss.scope.version = scope.get("version", "")
            _fill_attributes(ss.scope.attributes, scope.get("attributes", ()))
            _fill_spans(ss.spans, ss_doc.get("spans", ()))
    return req


def _fill_spans(out: Any, spans: Sequence[JsonSpan]) -> None:
    fromhex = bytes.fromhex
    for doc in spans:
        span = out.add()
        span.trace_id = fromhex(doc["traceId"])
        span.span_id = fromhex(doc["spanId"])
        parent = doc.get("parentSpanId")
        if parent:
            span.parent_span_id = fromhex(parent)
        span.name = doc["name"]
        span.kind = doc["kind"]
        span.start_time_unix_nano = int(doc["startTimeUnixNano"])
        span.end_time_unix_nano = int(doc["endTimeUnixNano"])
        _fill_attributes(span.attributes, doc.get("attributes", ()))
        status = doc.get("status")
        if status is not None:  # present-but-empty must stay present, as json_format would parse it
            span.status.SetInParent()
            if status:
                span.status.code = status.get("code", 0)
                span.status.message = status.get("message", "")
        for link in doc.get("links", ()):
            pl = span.links.add()
            pl.trace_id = fromhex(link["traceId"])
            pl.span_id = fromhex(link["spanId"])
            _fill_attributes(pl.attributes, link.get("attributes", ()))
        for event in doc.get("events", ()):
            pe = span.events.add()
            pe.time_unix_nano = int(event["timeUnixNano"])
            pe.name = event["name"]
            _fill_attributes(pe.attributes, event.get("attributes", ()))


# ---- OTel SDK ReadableSpan (the reference candidate in bench/export.py) ---------------------------
def _plain_value(value: Mapping[str, Any]) -> Any:
    kind, v = next(iter(value.items()))
    if kind == "intValue":
        return int(v)
    if kind == "arrayValue":
        return tuple(_plain_value(item) for item in v.get("values", ()))
    return v


def spans_to_readable_spans(spans: Sequence[JsonSpan], resource: Any, dropped: int) -> list[Any]:
    """SDK ``ReadableSpan`` objects for ``spans`` (``resource``: an SDK ``Resource``)."""
    from opentelemetry.sdk.trace import Event, ReadableSpan
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

    scope = InstrumentationScope(SCOPE_NAME, SCOPE_VERSION, None, {DROPPED_SCOPE_ATTRIBUTE: dropped})
    flags = TraceFlags(TraceFlags.SAMPLED)
    out: list[Any] = []
    for doc in spans:
        trace_id = int(doc["traceId"], 16)
        parent_hex = doc.get("parentSpanId")
        status = doc.get("status") or {}
        out.append(
            ReadableSpan(
                name=doc["name"],
                context=SpanContext(trace_id, int(doc["spanId"], 16), False, flags),
                parent=SpanContext(trace_id, int(parent_hex, 16), False, flags) if parent_hex else None,
                resource=resource,
                attributes={a["key"]: _plain_value(a["value"]) for a in doc.get("attributes", ())},
                events=[
                    Event(
                        e["name"],
                        {a["key"]: _plain_value(a["value"]) for a in e.get("attributes", ())},
                        int(e["timeUnixNano"]),
                    )
                    for e in doc.get("events", ())
                ],
                links=[
                    Link(SpanContext(int(lk["traceId"], 16), int(lk["spanId"], 16), False, flags))
                    for lk in doc.get("links", ())
                ],
                kind=SpanKind.INTERNAL,
                status=Status(StatusCode.ERROR, status.get("message")) if status.get("code") == 2 else Status(),
                start_time=int(doc["startTimeUnixNano"]),
                end_time=int(doc["endTimeUnixNano"]),
                instrumentation_scope=scope,
            )
        )
    return out


# ---- spans of run-time values (asynccheck's engine steps, loadgen's requests) -----------------------
def json_span(trace_id: int, span_id: int, parent_id: int | None, name: str, start: int, end: int,
              attributes: Mapping[str, Any], *, events: Sequence[tuple[str, int]] = (),
              error: str | None = None) -> JsonSpan:
    """One INTERNAL span in the ``SpanBuilder`` shape (hex ids, ns as decimal strings); ``events`` are
    ``(name, time)``, ``error`` makes the status ERROR with that message."""
    span: JsonSpan = {"traceId": f"{trace_id:032x}", "spanId": f"{span_id:016x}"}
    if parent_id is not None:
        span["parentSpanId"] = f"{parent_id:016x}"
    span.update(name=name, kind=SPAN_KIND_INTERNAL, startTimeUnixNano=str(start), endTimeUnixNano=str(end),
                attributes=[any_attr(k, v) for k, v in attributes.items()],
                status={} if error is None else {"code": STATUS_CODE_ERROR, "message": error})
    if events:
        span["events"] = [{"timeUnixNano": str(t), "name": n} for n, t in events]
    return span
