"""Seeded fuzz of the receiver: every request gets an answer, lands in exactly one counter, and what is
acknowledged is exactly what is written. ``bench/fuzz.py --target receiver`` runs thousands."""

from __future__ import annotations

import gzip
import json
import random
import zlib
from pathlib import Path

import grpc
import orjson
import requests
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from otel_kvtrace.collect import Receiver, ReceiverStats
from otel_kvtrace.export.otlp_json import request_to_json_line
from tests.collect.helpers import collected_span_ids

EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
ANSWERS = {200, 400, 404, 405, 411, 413, 415, 501, 503}


def _valid(rng: random.Random, seed: int) -> ExportTraceServiceRequest:
    req = ExportTraceServiceRequest()
    ss = req.resource_spans.add().scope_spans.add()
    for i in range(rng.randint(1, 5)):
        ss.spans.add(name=rng.choice(["backend_submit", "<b>x</b>", "\u00e9"]), trace_id=seed.to_bytes(16, "big"),
                     span_id=(seed * 100 + i + 1).to_bytes(8, "big"), start_time_unix_nano=rng.randint(0, 2**63),
                     end_time_unix_nano=rng.randint(0, 2**63))
    return req


def _mutate_json(rng: random.Random, doc: object) -> object:
    """Replace one value somewhere in ``doc`` by a value of another JSON type."""
    hostile = [5, "x", None, [], {}, [5], {"a": 1}, True, -1, 1.5, "zz", 2**70]
    if isinstance(doc, dict) and doc and rng.random() < 0.8:
        key = rng.choice(list(doc))
        doc[key] = _mutate_json(rng, doc[key]) if rng.random() < 0.7 else rng.choice(hostile)
        return doc
    if isinstance(doc, list) and doc and rng.random() < 0.8:
        i = rng.randrange(len(doc))
        doc[i] = _mutate_json(rng, doc[i]) if rng.random() < 0.7 else rng.choice(hostile)
        return doc
    return rng.choice(hostile)


def make_request(rng: random.Random, seed: int) -> tuple[str, dict[str, str], bytes, ExportTraceServiceRequest | None]:
    """(path, headers, body, the request if it is a valid one)."""
    valid = _valid(rng, seed)
    kind = rng.random()
    path = "/v1/traces" if rng.random() < 0.95 else rng.choice(["/v1/metrics", "/", "/v1/traces/x"])
    if kind < 0.3:
        body, ctype, ok = valid.SerializeToString(), "application/x-protobuf", valid
    elif kind < 0.5:
        body, ctype, ok = request_to_json_line(valid), "application/json", valid
    elif kind < 0.75:
        doc = _mutate_json(rng, orjson.loads(request_to_json_line(valid)))
        body, ctype, ok = json.dumps(doc).encode(), "application/json", None  # json: ints beyond 64 bits
    elif kind < 0.9:
        raw = bytearray(valid.SerializeToString())
        for _ in range(rng.randint(1, 4)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        body, ctype, ok = bytes(raw), "application/x-protobuf", None
    else:
        body, ctype, ok = rng.randbytes(rng.randint(0, 300)), rng.choice(
            ["application/x-protobuf", "application/json", "text/plain"]), None
    headers = {"Content-Type": ctype}
    enc = rng.random()
    if enc < 0.15:
        body, headers["Content-Encoding"] = gzip.compress(body), "gzip"
    elif enc < 0.2:
        body, headers["Content-Encoding"] = zlib.compress(body), "deflate"
    elif enc < 0.23:
        body, headers["Content-Encoding"] = gzip.compress(body)[:-5], "gzip"  # truncated stream
        ok = None
    if path != "/v1/traces":
        ok = None
    return path, headers, body, ok


def _accounted(s: ReceiverStats) -> int:
    return (s.http_requests + s.malformed_http + s.truncated_http + s.too_large + s.refused_full
            + s.refused_stopping + s.refused_memory + s.refused_timeout + s.internal_errors + s.write_errors)


def fuzz_receiver(out_dir: Path, n_http: int, n_grpc: int, seed: int) -> ReceiverStats:
    """Send ``n_http`` + ``n_grpc`` generated requests; assert every invariant; return the counts."""
    rng = random.Random(seed)
    acked: set[tuple[str, str]] = set()

    def ids(req: ExportTraceServiceRequest) -> set[tuple[str, str]]:
        return {(sp.trace_id.hex(), sp.span_id.hex()) for rs in req.resource_spans for ss in rs.scope_spans
                for sp in ss.spans}

    with Receiver(out_dir, grpc_port=0, http_port=0) as rx, requests.Session() as s:
        url = f"http://127.0.0.1:{rx.http_port}"
        for n in range(1, n_http + 1):
            path, headers, body, valid = make_request(rng, seed * 1_000_000 + n)
            r = s.request(rng.choice(["POST"] * 9 + ["PUT"]), url + path, data=body, headers=headers, timeout=30)
            assert r.status_code in ANSWERS, (r.status_code, body[:80])
            if r.status_code == 200 and valid is not None:
                acked |= ids(valid)
        with grpc.insecure_channel(f"127.0.0.1:{rx.grpc_port}") as ch:
            for n in range(n_http + 1, n_http + n_grpc + 1):
                _, _, body, valid = make_request(rng, seed * 1_000_000 + n)
                try:
                    ch.unary_unary(EXPORT)(body, timeout=30)
                except grpc.RpcError as err:
                    assert err.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED), err
                else:
                    if valid is not None and body == valid.SerializeToString():
                        acked |= ids(valid)
        stats = rx.stop()
    assert stats.internal_errors == 0
    assert _accounted(stats) == n_http  # every HTTP request is in exactly one counter
    assert stats.grpc_requests + stats.malformed_grpc == n_grpc
    written = collected_span_ids(out_dir)  # every written line parses
    assert acked <= set(written)
    assert stats.spans_written == sum(written.values())
    return stats


def test_random_http_and_grpc_requests_are_all_answered_and_counted(tmp_path: Path) -> None:
    stats = fuzz_receiver(tmp_path, 300, 100, seed=16)
    assert stats.malformed_http > 50 and stats.http_requests > 50  # both kinds were generated
