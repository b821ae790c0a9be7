"""``KVTraceInstrumentor`` is the one composition root: its keywords work (tracer_provider, meter_provider),
a wrong call raises instead of silently leaving tracing off, and the vLLM plugin shares its idempotence."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider

from otel_kvtrace.instrument import plugin
from otel_kvtrace.instrument.instrumentor import KVTraceInstrumentor
from otel_kvtrace.replica import ReplicaConfig, replica_targets
from otel_kvtrace.replica.threaded import run_threaded


@pytest.fixture(autouse=True)
def _fresh_instrumentor() -> Iterator[None]:
    plugin.stop()
    yield
    plugin.stop()


def _resource_of_first_line(out: Path) -> dict[str, object]:
    (path,) = (out / "traces").glob("*.jsonl")
    doc = orjson.loads(path.read_bytes().splitlines()[0])
    attrs = doc["resourceSpans"][0]["resource"]["attributes"]
    return {a["key"]: next(iter(a["value"].values())) for a in attrs}


def test_tracer_and_meter_providers_are_used_not_fatal(tmp_path: Path) -> None:
    cfg = ReplicaConfig(num_layers=4, num_shared_buffers=2, prefetch_layers=2, steps=2)
    reader = InMemoryMetricReader()
    tracer_provider = TracerProvider(resource=Resource.create({"service.name": "my-server", "deployment": "d1"}))
    instrumentor = KVTraceInstrumentor()
    instrumentor.instrument(targets=replica_targets(cfg.behaviour), out_dir=tmp_path, run_id="root",
                            tracer_provider=tracer_provider, meter_provider=MeterProvider(metric_readers=[reader]))
    session = instrumentor.session
    assert session is not None, instrumentor.off_reason
    assert run_threaded(cfg).error is None
    session.recorder.count_drop(3)  # as if the hand-off had overflowed
    plugin.stop()

    resource = _resource_of_first_line(tmp_path)
    assert resource["service.name"] == "my-server" and resource["deployment"] == "d1"
    assert resource["kvtrace.source"] == "replica" and resource["kvtrace.run_id"] == "root"
    values = {m.name: [p.value for p in m.data.data_points] for rm in reader.get_metrics_data().resource_metrics
              for sm in rm.scope_metrics for m in sm.metrics}
    assert values["kvtrace.exporter.dropped_records"] == [3]
    delivered = session.exporter.stats().delivered
    assert delivered > 0 and values["kvtrace.exporter.delivered_records"] == [delivered]
    assert values["kvtrace.exporter.spooled_records"] == [0]


def test_a_wrong_keyword_raises_and_leaves_the_instrumentor_usable(tmp_path: Path) -> None:
    cfg = ReplicaConfig(num_layers=4, num_shared_buffers=2, prefetch_layers=2, steps=1)
    instrumentor = KVTraceInstrumentor()
    with pytest.raises(TypeError, match="unknown keyword.*no_such_option"):
        instrumentor.instrument(targets=replica_targets(cfg.behaviour), no_such_option=1)
    assert not instrumentor.is_instrumented_by_opentelemetry and instrumentor.session is None
    with pytest.raises(ValueError, match="protocol"):
        instrumentor.instrument(targets=replica_targets(cfg.behaviour), endpoint="http://127.0.0.1:1",
                                protocol="carrier-pigeon")
    assert not instrumentor.is_instrumented_by_opentelemetry
    instrumentor.instrument(targets=replica_targets(cfg.behaviour), out_dir=tmp_path)
    assert instrumentor.session is not None


def test_plugin_and_instrumentor_instrument_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = ReplicaConfig(num_layers=4, num_shared_buffers=2, prefetch_layers=2, steps=1)
    targets = replica_targets(cfg.behaviour)
    session = plugin.ensure_started(targets, out_dir=tmp_path)
    assert session is not None
    instrumentor = KVTraceInstrumentor()
    assert instrumentor.is_instrumented_by_opentelemetry and instrumentor.session is session
    assert plugin.ensure_started(targets, out_dir=tmp_path) is session  # no second session, no warning
    with caplog.at_level(logging.WARNING):
        instrumentor.instrument(targets=targets)  # BaseInstrumentor's own guard: one mechanism
    assert instrumentor.session is session
    plugin.stop()
    assert not instrumentor.is_instrumented_by_opentelemetry and plugin.current_session() is None


def test_an_untraceable_process_says_why(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(plugin.ENV_ENABLED, "1")
    instrumentor = KVTraceInstrumentor()
    with caplog.at_level(logging.WARNING, logger="otel_kvtrace"):
        instrumentor.instrument()  # what opentelemetry-instrument does; vllm_ascend is not importable here
    assert instrumentor.session is None
    assert instrumentor.off_reason is not None and "vllm_ascend is not importable" in instrumentor.off_reason
    # nothing is traced in this process (no vLLM either): one warning that says so for both parts
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert "vllm_ascend is not importable" in warning and "engine-loop tracing is off" in warning, warning


PLAIN_VLLM_INSTRUMENT = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(message)s")
from tests.asynccheck import vllm_engine as ve
from tests.asynccheck.vllm_src import vllm_modules
from otel_kvtrace.instrument import plugin
from otel_kvtrace.instrument.instrumentor import KVTraceInstrumentor
with vllm_modules("0.33.0", ve.setup_torch):
    plugin.register()                 # vLLM's plugin hook: engine-loop tracing on, no vllm_ascend
    KVTraceInstrumentor().instrument()  # then opentelemetry-instrument's entry point in the same process
    print("OFF_REASON", KVTraceInstrumentor().off_reason)
"""


def test_plain_vllm_with_engine_loop_tracing_on_is_not_reported_as_tracing_off(tmp_path: Path) -> None:
    """Issue #13: on plain vLLM the engine loop is traced, so neither the plugin nor the instrumentor may
    warn "tracing off"; one INFO line says KV-pool tracing is off and engine-loop tracing is on."""
    import os
    import subprocess
    import sys

    from tests.asynccheck.vllm_src import vllm_source

    vllm_source("0.33.0")
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, OTEL_KVTRACE_ENABLED="1", OTEL_KVTRACE_DATA_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", PLAIN_VLLM_INSTRUMENT], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [ln for ln in proc.stdout.splitlines() if "otel-kvtrace" in ln or ln.startswith("OFF_REASON")]
    assert not [ln for ln in lines if ln.startswith("WARNING")], lines
    off = [ln for ln in lines if "KV-pool tracing off" in ln]
    assert len(off) == 1 and off[0].startswith("INFO") and "engine-loop (async-scheduling) tracing is on" in off[0]
    assert any(ln.startswith("OFF_REASON") and "vllm_ascend is not importable" in ln for ln in lines), lines
