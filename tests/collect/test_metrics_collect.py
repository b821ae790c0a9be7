"""`kvtrace collect` receives OTLP metrics: real serve-replica processes export resource series to it over
gRPC and HTTP, `kvtrace report` on its output shows them; a wrong-shape metrics body is 400 and counted."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import orjson
import pytest
import requests
from click.testing import CliRunner

from otel_kvtrace.cli import main
from otel_kvtrace.collect import Receiver
from otel_kvtrace.loadgen import LoadProfile, run_load
from tests.collect.helpers import CollectProcess

METRICS_EXPORT = "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export"


def _serve(data: Path, endpoint: str, protocol: str) -> tuple[str, subprocess.Popen[str]]:
    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": protocol}
    env.pop("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "otel_kvtrace.cli", "serve-replica", "--port", "0", "--data-dir", str(data)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    match = re.search(r"http://127\.0\.0\.1:\d+", proc.stdout.readline())
    assert match, proc.stderr.read() if proc.poll() is not None else "no listening line"
    return match.group(0), proc


def test_serve_replica_resources_over_grpc_and_http_reach_collect_and_report(tmp_path: Path) -> None:
    out = tmp_path / "collected"
    collector = CollectProcess(out)
    servers = []
    try:
        servers = [_serve(tmp_path / "grpc", f"http://127.0.0.1:{collector.grpc_port}", "grpc"),
                   _serve(tmp_path / "http", f"http://127.0.0.1:{collector.http_port}", "http/protobuf")]
        for url, _ in servers:
            result = run_load(LoadProfile(url, "/v1/completions", None, num_requests=8, concurrency=4,
                                          prompt_len=2000, output_len=3))
            assert result.summary()["failed"] == 0
    finally:
        for _, proc in servers:
            proc.send_signal(signal.SIGTERM)  # the sampler's MeterProvider flushes its last export at exit
            assert proc.wait(30) == 0, proc.stderr.read() if proc.stderr else ""
        code, err = collector.terminate(signal.SIGTERM)
    assert code == 0, err
    m = re.search(r"metric points: received (\d+), written (\d+)", err)
    assert m and int(m.group(1)) == int(m.group(2)) > 0, err
    metric_files = sorted((out / "metrics").glob("otlp-metrics-collected-*.jsonl"))
    assert len(metric_files) == 1, list(out.rglob("*"))
    run_ids = {a["value"]["stringValue"] for line in metric_files[0].read_bytes().splitlines()
               for rm in orjson.loads(line)["resourceMetrics"] for a in rm["resource"]["attributes"]
               if a["key"] == "kvtrace.run_id"}
    assert len(run_ids) == 2  # one per server, i.e. both protocols delivered

    report_json = tmp_path / "report.json"
    res = CliRunner().invoke(main, ["report", str(out), "--no-cache", "--json", str(report_json)])
    assert res.exit_code == 0, res.output
    assert "malformed" not in res.output  # the metrics file is not read as traces
    assert "Resources per step" in res.output and "outstanding_leases" in res.output
    resources = orjson.loads(report_json.read_bytes())["resources"]
    assert resources["files"] == [str(metric_files[0])] and resources["skipped"] == []
    summary = resources["summary"]
    assert summary["host_rss_bytes"]["peak"] > 10 * 2**20
    assert summary["tasks_in_flight"]["samples"] >= 2  # >= one step per server
    for key in ("peak", "p50", "p95", "p99"):
        assert summary["outstanding_leases"][key] >= 0


@pytest.fixture
def rx(tmp_path: Path):
    receiver = Receiver(tmp_path, grpc_port=0, http_port=0).start()
    yield receiver
    receiver.stop()


@pytest.mark.parametrize("body", [b'{"resourceMetrics": 5}', b'{"resourceMetrics": [{"scopeMetrics": "x"}]}', b"[1]"])
def test_wrong_shape_metrics_json_is_400_and_counted(rx: Receiver, body: bytes) -> None:
    r = requests.post(f"http://127.0.0.1:{rx.http_port}/v1/metrics", data=body,
                      headers={"Content-Type": "application/json"}, timeout=10)
    assert r.status_code == 400 and "metrics request" in r.json()["message"]
    stats = rx.stop()
    assert stats.malformed_http == 1 and stats.metric_points_received == 0 and stats.lines_written == 0
    assert not rx.metrics_path.exists()


def test_undecodable_metrics_protobuf_is_invalid_argument_over_grpc_and_http(rx: Receiver) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{rx.grpc_port}") as ch, pytest.raises(grpc.RpcError) as err:
        ch.unary_unary(METRICS_EXPORT)(b"\x0a\xff", timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    r = requests.post(f"http://127.0.0.1:{rx.http_port}/v1/metrics", data=b"\x0a\xff",
                      headers={"Content-Type": "application/x-protobuf"}, timeout=10)
    assert r.status_code == 400
    stats = rx.stop()
    assert stats.malformed_grpc == 1 and stats.malformed_http == 1


def test_metrics_json_is_acknowledged_after_it_is_written_and_answered_in_kind(rx: Receiver) -> None:
    body = orjson.dumps({"resourceMetrics": [{"scopeMetrics": [{"metrics": [
        {"name": "kvtrace.resource.step", "gauge": {"dataPoints": [{"timeUnixNano": "5", "asInt": "3"}]}},
        {"name": "kvtrace.resource.tasks_in_flight", "gauge": {"dataPoints": [{"timeUnixNano": "5", "asInt": "7"}]}},
    ]}]}]})
    r = requests.post(f"http://127.0.0.1:{rx.http_port}/v1/metrics", data=body,
                      headers={"Content-Type": "application/json"}, timeout=10)
    assert r.status_code == 200 and r.headers["Content-Type"] == "application/json"
    assert rx.metrics_path.read_bytes().count(b"\n") == 1  # on disk before the answer
    stats = rx.stop()
    assert stats.http_requests == 1 and stats.metric_points_received == stats.metric_points_written == 2
    assert stats.spans_received == 0
    from otel_kvtrace.resources import load_resources, resource_summary

    assert resource_summary(load_resources([rx.out_dir]))["tasks_in_flight"]["peak"] == 7
