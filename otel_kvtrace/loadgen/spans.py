"""Request spans of a load run, delivered through the project's one exporter (``export.create_sink``).

One span ``kvtrace.load.request`` per request from send to last chunk, an event ``first_token``, and
``kvtrace.request_id`` = the response id, which joins the KV tasks' ``kvtrace.request_ids`` (equal, or
``{id}-{n}`` on vLLM's completions endpoint). The endpoint and protocol are resolved exactly as for the KV
traces: an OTLP endpoint gets the spooling, retrying ``DeliveringSink``; without one the file goes next to
the KV traces (``{data_dir}/traces/kvtrace-{run_id}-{pid}.jsonl``) so ``kvtrace report`` and the experiment
read both. Spans are built with the OTel SDK and encoded with its OTLP encoder.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import Status, StatusCode

from otel_kvtrace.export.otlp_json import request_to_json_line
from otel_kvtrace.export.worker import build_resource, create_sink
from otel_kvtrace.loadgen.model import LoadResult

SPAN_NAME = "kvtrace.load.request"
BATCH = 256


@dataclass(slots=True)
class SpanDelivery:
    """Where the request spans went: every span is delivered (or written), spooled, or dropped."""

    where: str
    spans: int
    delivered: int
    spooled: int
    dropped: int

    def line(self) -> str:
        if self.spooled or self.dropped:
            return (f"{self.where}: {self.delivered} of {self.spans} request spans delivered, {self.spooled} "
                    f"spooled for `kvtrace resend`, {self.dropped} dropped")
        return f"{self.where}: {self.spans} request spans"


class _Collect(SpanExporter):
    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.spans.extend(spans)
        return SpanExportResult.SUCCESS


def span_texts(spans: Sequence[ReadableSpan]) -> list[str]:
    """The SDK spans as OTLP/JSON span objects (the sinks' input), one text per span."""
    doc = orjson.loads(request_to_json_line(encode_spans(spans)))
    return [orjson.dumps(s).decode() for rs in doc.get("resourceSpans", ()) for ss in rs.get("scopeSpans", ())
            for s in ss.get("spans", ())]


def export_request_spans(result: LoadResult, data_dir: Path, run_id: str, *, endpoint: str | None = None,
                         protocol: str | None = None) -> SpanDelivery:
    """Export one span per request through ``create_sink``; says where they went and what was lost."""
    resource = build_resource({"service.name": "kvtrace-load", "kvtrace.run_id": run_id, "kvtrace.source": "load"})
    collect = _Collect()
    provider = TracerProvider(resource=Resource.create(resource))
    provider.add_span_processor(SimpleSpanProcessor(collect))
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
    return _deliver(span_texts(collect.spans), resource, data_dir, endpoint, protocol)


def _deliver(texts: list[str], resource: dict[str, object], data_dir: Path, endpoint: str | None,
             protocol: str | None) -> SpanDelivery:
    sink = create_sink(resource, out_dir=data_dir, endpoint=endpoint, protocol=protocol)
    lost = 0
    for i in range(0, len(texts), BATCH):
        part = texts[i:i + BATCH]
        if not sink.export(part, lost):
            lost += len(part)
    sink.shutdown()
    where = str(getattr(sink, "path", None) or getattr(sink, "endpoint", None) or type(sink).__name__)
    stats = getattr(sink, "stats", None)
    if callable(stats):  # the delivering sink accounts for every accepted span
        s = stats()
        return SpanDelivery(where, len(texts), s.delivered, s.spooled, s.dropped + lost)
    return SpanDelivery(where, len(texts), len(texts) - lost, 0, lost)
