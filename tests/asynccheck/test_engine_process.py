"""The engine-core process forked or spawned from the plugin-loaded process writes its own trace.

Real processes (``engine_process``): the parent installs as the vLLM plugin does, the child runs the
real vLLM 0.33 engine loop and exits through multiprocessing's ``os._exit`` (no ``atexit``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from otel_kvtrace.asynccheck import analysis

from . import vllm_engine as ve
from .engine_process import STEPS
from .test_dp_runs import _true_gap_ms
from .test_vllm_conformance import assert_gap, measured_step_gaps
from .vllm_src import vllm_source

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "export"))  # the exporter tests' loopback OTLP receiver
from test_export_otlp import http_receiver  # noqa: E402,F401 - a fixture


@pytest.mark.parametrize("method", ["fork", "spawn"])
@pytest.mark.parametrize("blocking", [False, True], ids=["async", "serialised"])
def test_engine_core_child_writes_its_trace(tmp_path: Path, method: str, blocking: bool) -> None:
    vllm_source("0.33.0")  # fetched (once) outside the timed child
    out = tmp_path / "data" / "async"
    env = dict(os.environ, OTEL_KVTRACE_ENABLED="1", OTEL_KVTRACE_RUN_ID="../../escape")
    proc = subprocess.run([sys.executable, "-m", "tests.asynccheck.engine_process", method, str(out)]
                          + ["blocking"] * blocking, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    child_pid, exitcode = proc.stdout.split()
    assert exitcode == "0", proc.stderr[-2000:]
    files = sorted(p for p in tmp_path.rglob("*.jsonl"))
    # the run id cannot move the file out of the data directory, and only the engine process wrote one
    assert [p.parent for p in files] == [out]
    assert [p.name for p in files] == [f"kvtrace-async-_.._escape-{child_pid}.jsonl"]
    for line in files[0].read_bytes().splitlines():  # the child's own pid, not the inherited resource's
        resource = {a["key"]: a["value"] for a in json.loads(line)["resourceSpans"][0]["resource"]["attributes"]}
        assert resource["process.pid"] == {"intValue": child_pid}
    result = analysis.check(files)
    assert result.metrics.steps >= STEPS
    true_gap = _true_gap_ms(json.loads((out / "truth.json").read_text()))
    gap = result.metrics.gap_p50_ms
    assert gap is not None
    if not blocking:
        assert result.verdict == analysis.EFFECTIVE, result.reasons
        assert true_gap < 0.05 and gap < 0.1, (gap, true_gap)
    else:
        assert result.verdict == analysis.NOT_EFFECTIVE, result.reasons
        assert any("launch returns only after the device output is ready" in r for r in result.reasons)
        truth = json.loads((out / "truth.json").read_text())
        assert_gap(result, ve.true_gaps_ms(truth["device"], truth["wake_lags"]), measured_step_gaps(files, "r"))


PLAIN_VLLM = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(message)s")
from tests.asynccheck import vllm_engine as ve
from tests.asynccheck.vllm_src import vllm_modules
from otel_kvtrace.instrument import plugin
with vllm_modules("0.33.0", ve.setup_torch):
    plugin.register()
    plugin.register()
"""


def test_plugin_on_plain_vllm_says_engine_loop_tracing_is_on(tmp_path: Path) -> None:
    vllm_source("0.33.0")
    env = dict(os.environ, OTEL_KVTRACE_ENABLED="1", OTEL_KVTRACE_DATA_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", PLAIN_VLLM], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [ln for ln in proc.stdout.splitlines() if "otel-kvtrace" in ln]
    assert not [ln for ln in lines if ln.startswith("WARNING")], lines
    on = [ln for ln in lines if "engine-loop tracing on" in ln]
    assert len(on) == 1 and f"traces in {tmp_path / 'async'}" in on[0], lines
    assert len([ln for ln in lines if "KV-pool tracing off" in ln]) == 1, lines


def _wrapt_1(version: str = "1.17.3") -> Path:
    """wrapt 1.x installed next to the venv (cached), put first on ``PYTHONPATH`` by the test."""
    target = Path(sys.prefix) / "kvtrace-cache" / f"wrapt-{version}"
    if not (target / "wrapt").is_dir():
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(target),
                               f"wrapt=={version}"], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-1500:]
    return target


@pytest.mark.parametrize("wrapt_major", ["1", "2"])
def test_one_wrapper_layer_per_method_under_wrapt_1_and_2(wrapt_major: str) -> None:

    vllm_source("0.33.0")
    env = dict(os.environ)
    if wrapt_major == "1":
        env["PYTHONPATH"] = os.pathsep.join([str(_wrapt_1()), str(REPO)])
    proc = subprocess.run([sys.executable, "-m", "tests.asynccheck.wrapt_layers"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["wrapt"].startswith(wrapt_major + ".")
    assert report["layers"]["MultiprocExecutor.execute_model"] == 1
    assert set(report["layers"].values()) == {1}, report["layers"]
    assert report["comm_per_call"] == 1


ENGINE_IN_PROCESS = """
from tests.asynccheck import vllm_engine as ve
from tests.asynccheck.vllm_src import vllm_modules
from otel_kvtrace.asynccheck import instrument
with vllm_modules("0.33.0", ve.setup_torch) as mods:
    assert instrument.install_from_env() is not None
    timing = ve.Timing()
    ex = ve.make_executor(mods, "uniproc", timing, True)
    ve.run_engine(ve.make_engine(mods, async_loop=True, executor=ex, scheduler=ve.FakeScheduler(12, timing)))
    instrument._ACTIVE[1].shutdown()
"""


def test_otlp_endpoint_sends_engine_loop_spans_through_the_shared_sink(tmp_path: Path, http_receiver) -> None:
    endpoint, received = http_receiver
    vllm_source("0.33.0")
    env = dict(os.environ, OTEL_KVTRACE_ENABLED="1", OTEL_KVTRACE_DATA_DIR=str(tmp_path),
               OTEL_EXPORTER_OTLP_ENDPOINT=endpoint, OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
               OTEL_KVTRACE_RUN_ID="otlp-async")
    proc = subprocess.run([sys.executable, "-c", ENGINE_IN_PROCESS], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    names = [s.name for s in received.spans()]
    assert names.count("kvtrace.async.step") >= 12
    assert "execute_done" in names and "model_execute" in names
    resource = {kv.key: kv.value.string_value for kv in received.requests[0].resource_spans[0].resource.attributes}
    assert resource["kvtrace.run_id"] == "otlp-async" and resource["kvtrace.cfg.label"] == "engine-loop"
    assert not list(tmp_path.rglob("*.jsonl"))  # the endpoint replaces the local file, as for KV traces
