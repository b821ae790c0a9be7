"""Test helper run as a separate process: export N spans with the real OTel SDK OTLP exporter.

Usage: python sender.py {grpc|http} ENDPOINT N IDS_OUT.json [NAME]
Writes the (trace_id, span_id) hex pairs it created to IDS_OUT.json after a successful flush.
"""

from __future__ import annotations

import json
import sys

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor


def main() -> int:
    protocol, endpoint, n, ids_out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    name = sys.argv[5] if len(sys.argv) > 5 else f"sender-{protocol}"
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        exporter = GrpcExporter(endpoint=endpoint, insecure=True)
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpExporter,
        )

        exporter = HttpExporter(endpoint=endpoint)
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    provider.add_span_processor(
        BatchSpanProcessor(exporter, max_queue_size=2 * n + 1, max_export_batch_size=64, schedule_delay_millis=50)
    )
    tracer = provider.get_tracer("kvtrace-test-sender")
    ids = []
    for i in range(n):
        attrs = {"test.sender": name, "test.i": i}
        with tracer.start_as_current_span("kvtrace.recv.task", attributes=attrs) as root, \
                tracer.start_as_current_span("queue_wait") as child:
            pass
        for span in (root, child):
            ctx = span.get_span_context()
            ids.append([format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")])
    ok = provider.force_flush(30_000)
    provider.shutdown()
    with open(ids_out, "w") as fh:
        json.dump(ids, fh)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
