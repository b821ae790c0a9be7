"""Request spans of a load run through the OTel SDK: OTLP when an endpoint is set, else OTLP/JSON lines.

One span ``kvtrace.load.request`` per request from send to last chunk, an event ``first_token``, and
``kvtrace.request_id`` = the response id, which joins the KV tasks' ``kvtrace.request_ids`` (equal, or
``{id}-{n}`` on vLLM's completions endpoint). The file goes next to the KV traces
(``{data_dir}/traces/kvtrace-load-{run_id}.jsonl``) so ``kvtrace report`` and the experiment read both.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import Status, StatusCode

from otel_kvtrace.export.sinks import safe_run_id
from otel_kvtrace import config
from otel_kvtrace.export.otlp_json import request_to_json_line
from otel_kvtrace.loadgen.model import LoadResult

SPAN_NAME = "kvtrace.load.request"


class JsonLinesSpanExporter(SpanExporter):
    """SDK span exporter writing one OTLP/JSON ``ExportTraceServiceRequest`` per batch (the project's codec)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fh = open(path, "ab")

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self._fh.write(request_to_json_line(encode_spans(spans)))
        self._fh.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self._fh.close()


def _exporter(data_dir: Path, run_id: str) -> tuple[SpanExporter, str]:
    endpoint = config.otlp_endpoint()
    if endpoint is None:
        path = data_dir / "traces" / f"kvtrace-load-{safe_run_id(run_id)}.jsonl"
        return JsonLinesSpanExporter(path), str(path)
    if config.otlp_protocol() == config.PROTOCOL_GRPC:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # type: ignore[assignment]
    return OTLPSpanExporter(), endpoint


def export_request_spans(result: LoadResult, data_dir: Path, run_id: str) -> str:
    """Export one span per request; returns where they went (a file path or the endpoint)."""
    exporter, where = _exporter(data_dir, run_id)
    provider = TracerProvider(resource=Resource.create({"service.name": "kvtrace-load", "kvtrace.run_id": run_id,
                                                        "kvtrace.source": "load"}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    tracer = provider.get_tracer("otel_kvtrace.loadgen")
    for r in result.requests:
        span = tracer.start_span(SPAN_NAME, start_time=r.start_unix_ns, attributes={
            "kvtrace.request_id": r.request_id, "kvtrace.load.index": r.index,
            "kvtrace.load.prompt_tokens": r.prompt_tokens, "kvtrace.load.output_tokens": r.output_tokens,
            "kvtrace.load.ttft_ms": r.ttft_ms if r.ttft_ms is not None else -1.0,
            "kvtrace.load.tpot_ms": r.tpot_ms if r.tpot_ms is not None else -1.0,
        })
        if r.first_token_unix_ns:
            span.add_event("first_token", timestamp=r.first_token_unix_ns)
        if r.error:
            span.set_status(Status(StatusCode.ERROR, r.error))
        span.end(end_time=max(r.end_unix_ns, r.start_unix_ns))
    provider.shutdown()
    return where
