"""Off-hot-path export: task records -> spans (docs/schema.md) -> OTLP/gRPC, OTLP/HTTP or OTLP/JSON lines.

Public API::

    from otel_kvtrace.export import create_exporter
    exporter = create_exporter(recorder, {"kvtrace.source": "replica"})   # sink from OTEL_* env
    ...
    exporter.shutdown()

Heavy imports (gRPC, requests) happen only when a network sink is created.
"""

from __future__ import annotations

from otel_kvtrace.export.otlp_json import json_line_to_request, request_to_json_line
from otel_kvtrace.export.sinks import (
    JsonLinesFileSink,
    NullSink,
    OtlpGrpcSink,
    OtlpHttpSink,
    SpanSink,
    trace_file_path,
)
from otel_kvtrace.export.spans import SpanBuilder, build_task_spans, child_span_ids, summarize_transfer_tasks
from otel_kvtrace.export.worker import BackgroundExporter, build_resource, create_exporter, create_sink

__all__ = [
    "BackgroundExporter",
    "JsonLinesFileSink",
    "NullSink",
    "OtlpGrpcSink",
    "OtlpHttpSink",
    "SpanBuilder",
    "SpanSink",
    "build_resource",
    "build_task_spans",
    "child_span_ids",
    "create_exporter",
    "create_sink",
    "json_line_to_request",
    "request_to_json_line",
    "summarize_transfer_tasks",
    "trace_file_path",
]
