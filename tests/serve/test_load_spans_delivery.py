"""Request spans go through the project's delivering sink: acknowledged spans are counted, a receiver that
refuses everything leaves them spooled (counted), never silently lost."""

from __future__ import annotations

from pathlib import Path

import pytest

from otel_kvtrace.loadgen.model import LoadResult, RequestResult
from otel_kvtrace.loadgen.spans import export_request_spans
from tests.export.fault_receivers import HttpReceiver


def _result(n: int) -> LoadResult:
    return LoadResult({}, [RequestResult(i, f"chatcmpl-{i}", 1_000 + i, 2_000 + i, 3_000 + i, 5, 2) for i in range(n)],
                      1.0)


def test_spans_reach_a_real_otlp_http_receiver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_KVTRACE_SPOOL_DIR", str(tmp_path / "spool"))
    receiver = HttpReceiver()
    try:
        out = export_request_spans(_result(5), tmp_path, "load-1", endpoint=receiver.endpoint + "/v1/traces",
                                   protocol="http/protobuf")
    finally:
        receiver.stop()
    assert (out.spans, out.delivered, out.spooled, out.dropped) == (5, 5, 0, 0)
    assert len(receiver.acked.ids) == 5


def test_refusing_receiver_leaves_spans_spooled_and_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_KVTRACE_SPOOL_DIR", str(tmp_path / "spool"))
    monkeypatch.setenv("OTEL_KVTRACE_EXPORT_TIMEOUT_MS", "300")
    receiver = HttpReceiver(refuse=10_000, status=503)
    try:
        out = export_request_spans(_result(4), tmp_path, "load-2", endpoint=receiver.endpoint + "/v1/traces",
                                   protocol="http/protobuf")
    finally:
        receiver.stop()
    assert out.delivered == 0 and out.spooled + out.dropped == 4 and out.spooled == 4
    assert "spooled" in out.line()
    assert any((tmp_path / "spool").rglob("*"))


def test_without_endpoint_the_file_sits_next_to_the_kv_traces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    from otel_kvtrace.load import load_traces

    out = export_request_spans(_result(3), tmp_path, "load-3")
    assert Path(out.where).parent == tmp_path / "traces" and out.delivered == 3
    con = load_traces(tmp_path / "traces", require_tasks=False).con  # request spans only, no KV tasks
    assert con.execute("SELECT count(*) FROM spans WHERE name = 'kvtrace.load.request'").fetchone()[0] == 3
