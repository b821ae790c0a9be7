"""OTLP/JSON codec: Collector file-exporter shape, both directions, every value type."""

from __future__ import annotations

import orjson
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue, KeyValueList
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from otel_kvtrace.export.otlp_json import json_line_to_request, request_to_json_line

TRACE_ID = bytes.fromhex("0af7651916cd43dd8448eb211c80319c")
SPAN_ID = bytes.fromhex("b7ad6b7169203331")
PARENT_ID = bytes.fromhex("00f067aa0ba902b7")
LINK_TRACE = bytes.fromhex("4bf92f3577b34da6a3ce929d0e0e4736")
LINK_SPAN = bytes.fromhex("53995c3f42cd8ad8")


def _kv(key: str, **value: object) -> KeyValue:
    return KeyValue(key=key, value=AnyValue(**value))


def make_request() -> ExportTraceServiceRequest:
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.attributes.append(_kv("service.name", string_value="kvtrace"))
    ss = rs.scope_spans.add()
    ss.scope.name = "otel_kvtrace"
    ss.scope.attributes.append(_kv("kvtrace.exporter.dropped", int_value=3))
    span = ss.spans.add()
    span.trace_id = TRACE_ID
    span.span_id = SPAN_ID
    span.parent_span_id = PARENT_ID
    span.name = "save_cpu_wait"
    span.kind = Span.SPAN_KIND_INTERNAL
    span.start_time_unix_nano = 1_700_000_000_123_456_789
    span.end_time_unix_nano = 1_700_000_000_223_456_789
    span.attributes.extend(
        [
            _kv("s", string_value="gva"),
            _kv("b", bool_value=True),
            _kv("i", int_value=-(2**62)),
            _kv("d", double_value=1.5),
            _kv("bytes", bytes_value=b"\x00\xff"),
            _kv("arr", array_value=ArrayValue(values=[AnyValue(int_value=1), AnyValue(string_value="x")])),
            _kv("kv", kvlist_value=KeyValueList(values=[_kv("inner", int_value=7)])),
        ]
    )
    link = span.links.add()
    link.trace_id = LINK_TRACE
    link.span_id = LINK_SPAN
    link.attributes.append(_kv("kvtrace.link", string_value="producer_save"))
    event = span.events.add()
    event.name = "exception"
    event.time_unix_nano = 1_700_000_000_200_000_000
    event.attributes.append(_kv("exception.type", string_value="RuntimeError"))
    span.status.code = Status.STATUS_CODE_ERROR
    span.status.message = "boom"
    return req


def test_line_has_collector_file_exporter_shape() -> None:
    line = request_to_json_line(make_request())
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    doc = orjson.loads(line)
    span = doc["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    assert span["traceId"] == TRACE_ID.hex()
    assert span["spanId"] == SPAN_ID.hex()
    assert span["parentSpanId"] == PARENT_ID.hex()
    assert span["links"][0]["traceId"] == LINK_TRACE.hex()
    assert span["links"][0]["spanId"] == LINK_SPAN.hex()
    assert span["startTimeUnixNano"] == "1700000000123456789"
    assert span["endTimeUnixNano"] == "1700000000223456789"
    assert span["events"][0]["timeUnixNano"] == "1700000000200000000"
    assert span["kind"] == 1
    assert span["status"] == {"code": 2, "message": "boom"}
    attrs = {a["key"]: a["value"] for a in span["attributes"]}
    assert attrs["i"] == {"intValue": str(-(2**62))}
    assert attrs["b"] == {"boolValue": True}
    assert attrs["d"] == {"doubleValue": 1.5}
    assert attrs["arr"] == {"arrayValue": {"values": [{"intValue": "1"}, {"stringValue": "x"}]}}
    scope = doc["resourceSpans"][0]["scopeSpans"][0]["scope"]
    assert scope["attributes"][0] == {"key": "kvtrace.exporter.dropped", "value": {"intValue": "3"}}


def test_round_trip_is_lossless() -> None:
    req = make_request()
    back = json_line_to_request(request_to_json_line(req))
    assert back == req
    assert back.resource_spans[0].scope_spans[0].spans[0].links[0].span_id == LINK_SPAN


def test_parses_str_and_collector_written_line() -> None:
    # A line as the Collector writes it (hex ids, string int64, int enums, extra unknown field).
    line = (
        '{"resourceSpans":[{"resource":{"attributes":[{"key":"service.name","value":{"stringValue":"a"}}]},'
        '"scopeSpans":[{"scope":{"name":"s"},"spans":[{"traceId":"0af7651916cd43dd8448eb211c80319c",'
        '"spanId":"b7ad6b7169203331","parentSpanId":"","name":"n","kind":2,'
        '"startTimeUnixNano":"1581452772000000321","endTimeUnixNano":"1581452773000000789",'
        '"futureField":1,"status":{}}]}]}]}'
    )
    req = json_line_to_request(line)
    span = req.resource_spans[0].scope_spans[0].spans[0]
    assert span.trace_id == TRACE_ID
    assert span.span_id == SPAN_ID
    assert span.parent_span_id == b""
    assert span.kind == Span.SPAN_KIND_SERVER
    assert span.start_time_unix_nano == 1581452772000000321


BAD_ID = b'{"resourceSpans":[{"scopeSpans":[{"spans":[{"traceId":"zz"}]}]}]}'


@pytest.mark.parametrize("bad", [b"not json", b"[1]", BAD_ID])
def test_bad_input_raises_value_error(bad: bytes) -> None:
    with pytest.raises(ValueError):
        json_line_to_request(bad)
