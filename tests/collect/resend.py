"""Test helper run as a separate process: re-send OTLP/JSON trace files with the project's own exporter sinks.

Usage: python resend.py {grpc|http/protobuf} ENDPOINT SHARD SHARDS FILE...
Sends every line whose global index % SHARDS == SHARD, keeping each line's resource and drop count.
Exits 1 if any export failed.
"""

from __future__ import annotations

import sys
from typing import Any

import orjson

from otel_kvtrace.export import create_sink


def plain_value(value: dict[str, Any]) -> Any:
    """OTLP/JSON AnyValue -> Python value (what the sinks take as resource attributes)."""
    if "stringValue" in value:
        return value["stringValue"]
    if "intValue" in value:
        return int(value["intValue"])
    if "boolValue" in value:
        return bool(value["boolValue"])
    if "doubleValue" in value:
        return float(value["doubleValue"])
    if "arrayValue" in value:
        return [plain_value(v) for v in value["arrayValue"].get("values", [])]
    raise ValueError(f"unsupported attribute value {value!r}")


def main() -> int:
    protocol, endpoint, shard, shards, files = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:]
    sinks: dict[bytes, Any] = {}
    failed = index = 0
    for path in files:
        with open(path, "rb") as fh:
            for line in fh:
                index += 1
                if (index - 1) % shards != shard:
                    continue
                for rs in orjson.loads(line)["resourceSpans"]:
                    resource = {a["key"]: plain_value(a["value"]) for a in rs["resource"]["attributes"]}
                    key = orjson.dumps(resource, option=orjson.OPT_SORT_KEYS)
                    sink = sinks.get(key)
                    if sink is None:
                        sink = sinks[key] = create_sink(resource, endpoint=endpoint, protocol=protocol)
                    for ss in rs["scopeSpans"]:
                        dropped = next(
                            (int(a["value"]["intValue"]) for a in ss.get("scope", {}).get("attributes", [])
                             if a["key"] == "kvtrace.exporter.dropped"),
                            0,
                        )
                        # The sinks take span JSON texts that they join into one array (export.SpanSink).
                        texts = [orjson.dumps(span).decode() for span in ss["spans"]]
                        if not sink.export(texts, dropped):
                            failed += 1
    for sink in sinks.values():
        sink.shutdown()
        stats = getattr(sink, "stats", None)  # a DeliveringSink: spooled = not acknowledged by the receiver
        if stats is not None and stats().spooled:
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
