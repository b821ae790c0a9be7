"""`kvtrace collect` as a real process, fed by real OTel SDK exporters running in two other processes."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import requests

from tests.collect.helpers import CollectProcess, collected_span_ids, run_senders


def test_two_processes_grpc_and_http_at_once_every_span_exactly_once(tmp_path: Path) -> None:
    out = tmp_path / "traces"
    collector = CollectProcess(out)
    try:
        ids = run_senders(
            [
                ("grpc", f"http://127.0.0.1:{collector.grpc_port}", 400, tmp_path / "grpc.json"),
                ("http", f"http://127.0.0.1:{collector.http_port}/v1/traces", 400, tmp_path / "http.json"),
            ]
        )
    finally:
        code, err = collector.terminate(signal.SIGTERM)
    assert code == 0, err
    sent = ids[0] + ids[1]
    assert len(sent) == 2 * 400 * 2 and len(set(sent)) == len(sent)
    seen = collected_span_ids(out)
    assert set(seen) == set(sent)
    assert max(seen.values()) == 1
    assert [p.name for p in out.glob("*.jsonl")] == [f"collected-{collector.proc.pid}.jsonl"]
    m = re.search(r"accepted (\d+) grpc \+ (\d+) http requests, (\d+) spans; wrote (\d+) lines, (\d+) spans", err)
    assert m, err
    grpc_req, http_req, spans_in, lines, spans_out = map(int, m.groups())
    assert grpc_req > 0 and http_req > 0
    assert spans_in == spans_out == len(sent)
    assert lines == grpc_req + http_req


def test_sigterm_writes_everything_accepted_before_exit(tmp_path: Path) -> None:
    out = tmp_path / "traces"
    collector = CollectProcess(out)
    body = _request_bytes(spans=50)
    url = f"http://127.0.0.1:{collector.http_port}/v1/traces"
    with requests.Session() as s:
        for _ in range(200):
            r = s.post(url, data=body, headers={"Content-Type": "application/x-protobuf"})
            assert r.status_code == 200
    code, err = collector.terminate(signal.SIGTERM)  # right after the last 200: nothing waited for a flush
    assert code == 0, err
    lines = (out / f"collected-{collector.proc.pid}.jsonl").read_bytes().splitlines()
    assert len(lines) == 200
    assert "wrote 200 lines, 10000 spans" in err


def test_sigint_also_stops_cleanly(tmp_path: Path) -> None:
    collector = CollectProcess(tmp_path)
    code, err = collector.terminate(signal.SIGINT)
    assert code == 0, err
    assert "accepted 0 grpc + 0 http requests" in err


def _request_bytes(spans: int) -> bytes:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    req = ExportTraceServiceRequest()
    ss = req.resource_spans.add().scope_spans.add()
    for i in range(spans):
        sp = ss.spans.add(name="queue_wait", trace_id=bytes([1]) * 15 + bytes([i % 256]), span_id=(i + 1).to_bytes(8, "big"))
        sp.start_time_unix_nano, sp.end_time_unix_nano = 1_000 + i, 2_000 + i
    return req.SerializeToString()
