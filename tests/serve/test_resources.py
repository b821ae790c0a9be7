"""Resource series: per-step peaks, OTel metrics (file and real OTLP/HTTP), DuckDB table, kvtrace report."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from pathlib import Path

import orjson
import pytest
from aiohttp import web
from click.testing import CliRunner
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

from otel_kvtrace.cli import main
from otel_kvtrace.loadgen import LoadProfile, run_load
from otel_kvtrace.resources import load_resources, resource_summary
from otel_kvtrace.resources.sampler import ResourceSampler
from tests.serve.conftest import serve_replica, wait_exit


class _Probe:
    """Scripted polls, independent of timing: per step, a few mid-step values then 0 (as the recv queue
    does); after a step's last poll the probe itself ends the step (``notify_step``), so every poll lands
    in the step it was scripted for however slowly the sampler thread runs."""

    def __init__(self, peaks: list[int] | None = None) -> None:
        self.script = [(v, step if i == 3 else None) for step, p in enumerate(peaks or [])
                       for i, v in enumerate((p, p, 0, 0))]
        self.sampler: ResourceSampler | None = None
        self.done = threading.Event()

    def __call__(self) -> dict[str, int | None]:
        if not self.script:
            self.done.set()
            return {"tasks_in_flight": 0, "metadata_bytes": 0}
        value, end_step = self.script.pop(0)
        if end_step is not None and self.sampler is not None:
            self.sampler.notify_step(end_step)
        return {"tasks_in_flight": value, "metadata_bytes": value * 8}


def _drive(sampler: ResourceSampler, probe: _Probe, peaks: list[int]) -> None:
    assert probe.done.wait(30)


def _sampler(tmp_path: Path, run_id: str, peaks: list[int], **kw) -> tuple[ResourceSampler, _Probe]:
    probe = _Probe(peaks)
    sampler = ResourceSampler(None, tmp_path, run_id, poll_ms=2, probe=probe,
                              memory=lambda: {"host_rss_bytes": 1 << 20}, export_interval_ms=50, **kw)
    probe.sampler = sampler
    return sampler.start(), probe


def test_sampler_records_the_step_peak_not_the_boundary_value(tmp_path: Path) -> None:
    sampler, probe = _sampler(tmp_path, "r1", [3, 7, 5])
    _drive(sampler, probe, [3, 7, 5])
    sampler.stop()
    rows = [orjson.loads(line) for line in (tmp_path / "metrics" / "resources-r1.jsonl").read_bytes().splitlines()]
    assert [r["tasks_in_flight"] for r in rows[:3]] == [3, 7, 5]
    summary = resource_summary(load_resources([tmp_path]))
    assert summary["tasks_in_flight"]["peak"] == 7 and summary["metadata_bytes"]["peak"] == 56
    assert summary["tasks_in_flight"]["samples"] == len(rows)  # the run's OTLP points are not counted again
    otlp = (tmp_path / "metrics" / "otlp-metrics-r1.jsonl").read_bytes()
    assert b"kvtrace.resource.tasks_in_flight" in otlp and b"kvtrace.resource.host_rss" in otlp
    (tmp_path / "metrics" / "resources-r1.jsonl").unlink()  # what a collector holds: the OTLP points only
    from_otlp = resource_summary(load_resources([tmp_path]))
    steps = {r["step"] for r in rows}
    assert 1 <= from_otlp["tasks_in_flight"]["samples"] <= len(steps)  # one row per exported step, never more
    assert from_otlp["host_rss_bytes"]["peak"] == 1 << 20
    assert from_otlp["tasks_in_flight"]["peak"] <= 7


def test_metrics_reach_a_real_otlp_http_receiver(tmp_path: Path, monkeypatch) -> None:
    got: list[ExportMetricsServiceRequest] = []

    async def receive(request: web.Request) -> web.Response:
        msg = ExportMetricsServiceRequest()
        msg.ParseFromString(await request.read())
        got.append(msg)
        return web.Response(body=b"", content_type="application/x-protobuf")

    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_post("/v1/metrics", receive)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        sampler, probe = _sampler(tmp_path, "r2", [4, 9])
        _drive(sampler, probe, [4, 9])
        sampler.stop()
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
    values = {}
    for msg in got:
        for rm in msg.resource_metrics:
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    for point in metric.gauge.data_points:
                        values.setdefault(metric.name, []).append(point.as_int)
    assert 9 in values["kvtrace.resource.tasks_in_flight"], values
    assert not (tmp_path / "metrics" / "otlp-metrics-r2.jsonl").exists()  # endpoint set: no local metric file


def test_serve_replica_writes_resource_series_that_kvtrace_report_shows(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with serve_replica(data) as (url, proc):
        result = run_load(LoadProfile(url, "/v1/completions", None, num_requests=8, concurrency=4, prompt_len=2000,
                                      output_len=3))
        proc.send_signal(signal.SIGTERM)
        assert wait_exit(proc) == 0
    assert result.summary()["failed"] == 0
    summary = resource_summary(load_resources([data]))
    # hol preset: P=4 loads queued at a time; a 2000-word prompt is 16 blocks, each with a lease key
    assert 1 <= summary["tasks_in_flight"]["peak"] <= 8
    assert summary["outstanding_leases"]["peak"] >= 16
    assert summary["host_rss_bytes"]["peak"] > 10 * 2**20
    out = CliRunner().invoke(main, ["report", str(data / "traces"), "--no-cache"])
    assert out.exit_code == 0, out.output
    assert "Resources per step" in out.output and "outstanding_leases" in out.output


def test_a_half_written_resource_line_is_skipped_and_named(tmp_path: Path) -> None:
    path = tmp_path / "metrics" / "resources-r.jsonl"
    path.parent.mkdir()
    path.write_bytes(b'{"t_unix_ns": 1, "step": 0, "tasks_in_flight": 3}\n{"t_unix_ns": 2, "st')
    rejected: list[str] = []
    summary = resource_summary(load_resources([tmp_path], rejected=rejected))
    assert summary["tasks_in_flight"]["peak"] == 3 and summary["tasks_in_flight"]["samples"] == 1
    assert len(rejected) == 1 and rejected[0].startswith(f"{path}:2: JSONDecodeError")


def test_gauges_report_the_peak_since_the_last_collection_and_stop_writes_the_last_step(tmp_path: Path) -> None:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])  # the instrumentor's provider: the sampler uses it
    sampler, probe = _sampler(tmp_path, "r3", [3, 7, 5], meter_provider=provider)
    _drive(sampler, probe, [3, 7, 5])
    sampler.notify_step(3)  # a step that ends just before stop: its record must still be written
    sampler.stop()

    def gauge() -> list[int]:
        data = reader.get_metrics_data()
        return [p.value for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
                if m.name == "kvtrace.resource.tasks_in_flight" for p in m.data.data_points]

    assert gauge() == [7]  # not only the latest step's 5 (or 0)
    assert gauge() == [0]  # nothing new since: the latest record
    rows = [orjson.loads(x) for x in (tmp_path / "metrics" / "resources-r3.jsonl").read_bytes().splitlines()]
    assert [r["step"] for r in rows][-1] == 3
    assert not (tmp_path / "metrics" / "otlp-metrics-r3.jsonl").exists()  # no provider of its own


def test_idle_sampler_polls_slowly(tmp_path: Path) -> None:
    sampler, probe = _sampler(tmp_path, "r4", [])
    time.sleep(0.6)
    sampler.stop()
    assert sampler.polls < 60  # 2 ms polls would be ~300; idle polls every 50 ms after 0.1 s without a step


def test_outstanding_leases_include_the_running_final_task() -> None:
    import queue
    from types import SimpleNamespace

    from otel_kvtrace.resources.probe import WorkerProbe

    shared = SimpleNamespace(block_ids_arr=[1, 2, 3], load_keys=["k1", "k2", "k3"])
    task = SimpleNamespace(transfer_tasks=[SimpleNamespace(shared_block_data=shared)])  # the final layer's task
    recv = SimpleNamespace(request_queue=queue.Queue())
    worker = SimpleNamespace(kv_recv_thread=recv, kv_send_thread=None)
    probe = WorkerProbe(worker)
    recv.request_queue.put(task)
    assert probe()["outstanding_leases"] == 3
    recv.request_queue.get()  # the recv thread runs it: the leases stay until batch_remove_lease
    assert probe()["outstanding_leases"] == 3 and probe()["metadata_in_flight"] == 1
    recv.request_queue.task_done()
    assert probe()["outstanding_leases"] == 0


def test_instrumented_worker_gets_the_resource_series(tmp_path: Path) -> None:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from otel_kvtrace.instrument.instrumentor import KVTraceInstrumentor
    from otel_kvtrace.replica import ReplicaConfig, replica_targets
    from otel_kvtrace.replica.threaded import run_threaded

    cfg = ReplicaConfig(num_layers=4, num_shared_buffers=2, prefetch_layers=2, steps=30)
    reader = InMemoryMetricReader()
    instrumentor = KVTraceInstrumentor()
    instrumentor.instrument(targets=replica_targets(cfg.behaviour), out_dir=tmp_path, run_id="inst",
                            meter_provider=MeterProvider(metric_readers=[reader]))
    try:
        assert instrumentor.session is not None, instrumentor.off_reason
        assert run_threaded(cfg).error is None
    finally:
        instrumentor.uninstrument()
    rows = [orjson.loads(x) for x in (tmp_path / "metrics" / "resources-inst.jsonl").read_bytes().splitlines()]
    assert rows and max(r["step"] for r in rows) >= 1  # the worker's traced step counter drives the records
    names = {m.name for rm in reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    assert "kvtrace.resource.tasks_in_flight" in names


def test_otlp_points_of_one_step_count_once_and_a_bad_otlp_line_is_named(tmp_path: Path) -> None:
    def line(t: int, step: int, tasks: int) -> bytes:
        gauge = lambda name, v: {"name": f"kvtrace.resource.{name}",  # noqa: E731
                                 "gauge": {"dataPoints": [{"timeUnixNano": str(t), "asInt": str(v)}]}}
        return orjson.dumps({"resourceMetrics": [{
            "resource": {"attributes": [{"key": "kvtrace.run_id", "value": {"stringValue": "c"}}]},
            "scopeMetrics": [{"metrics": [gauge("step", step), gauge("tasks_in_flight", tasks)]}]}]})

    path = tmp_path / "metrics" / "otlp-metrics-collected-1.jsonl"
    path.parent.mkdir()
    # the second export repeats step 4 (the step did not move between two reader intervals)
    path.write_bytes(b"\n".join([line(10, 4, 6), line(20, 4, 6), line(30, 5, 2), b'{"resourceMetrics": 3}']))
    rejected: list[str] = []
    summary = resource_summary(load_resources([tmp_path], rejected=rejected))
    assert summary["tasks_in_flight"] == pytest.approx({"samples": 2, "peak": 6, "p50": 4.0, "p95": 5.8, "p99": 5.96})
    assert len(rejected) == 1 and rejected[0].startswith(f"{path}:4: TypeError")
