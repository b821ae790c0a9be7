"""Request spans of a load run, delivered through the project's one exporter (``export.create_sink``).

One span ``kvtrace.load.request`` per request from send to last chunk, an event ``first_token``, and
``kvtrace.request_id`` = the response id, which joins the KV tasks' ``kvtrace.request_ids`` (equal, or
``{id}-{n}`` on vLLM's completions endpoint). The endpoint and protocol are resolved exactly as for the KV
traces: an OTLP endpoint gets the spooling, retrying ``DeliveringSink``; without one the file goes next to
the KV traces (``{data_dir}/traces/kvtrace-{run_id}-{pid}.jsonl``) so ``kvtrace report`` and the experiment
read both. Spans are written as OTLP/JSON by the package's one encoder (``export.encode.json_span``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import orjson

from otel_kvtrace.export.encode import json_span
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


def request_span_texts(result: LoadResult) -> list[str]:
    """One ``kvtrace.load.request`` span per request as OTLP/JSON text (the sinks' input); random ids."""
    texts = []
    for r in result.requests:
        attrs = {
            "kvtrace.request_id": r.request_id, "kvtrace.load.index": r.index,
            "kvtrace.load.prompt_tokens": r.prompt_tokens, "kvtrace.load.output_tokens": r.output_tokens,
            "kvtrace.load.ttft_ms": r.ttft_ms if r.ttft_ms is not None else -1.0,
            "kvtrace.load.tpot_ms": r.tpot_ms if r.tpot_ms is not None else -1.0,
        }
        events = [("first_token", r.first_token_unix_ns)] if r.first_token_unix_ns else []
        span = json_span(random.getrandbits(128) or 1, random.getrandbits(64) or 1, None, SPAN_NAME,
                         r.start_unix_ns, max(r.end_unix_ns, r.start_unix_ns), attrs, events=events,
                         error=r.error or None)
        texts.append(orjson.dumps(span).decode())
    return texts


def export_request_spans(result: LoadResult, data_dir: Path, run_id: str, *, endpoint: str | None = None,
                         protocol: str | None = None) -> SpanDelivery:
    """Export one span per request through ``create_sink``; says where they went and what was lost."""
    resource = build_resource({"service.name": "kvtrace-load", "kvtrace.run_id": run_id, "kvtrace.source": "load"})
    return _deliver(request_span_texts(result), resource, data_dir, endpoint, protocol)


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
