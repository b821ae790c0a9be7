"""`kvtrace demo` with OTEL_EXPORTER_OTLP_ENDPOINT exported (common for Jaeger users): the traces go to
that endpoint (a real `kvtrace collect` receiver on loopback here) and the demo says so, instead of
an empty table and a "Traces in ..." folder that does not exist."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from otel_kvtrace.collect import ReceiverStats, collect


def test_demo_says_where_the_traces_went(tmp_path: Path) -> None:
    lines: list[str] = []
    stop = threading.Event()
    result: list[ReceiverStats] = []
    received = tmp_path / "received"
    runner = threading.Thread(target=lambda: result.append(collect(
        out=received, grpc_port=None, http_port=0, status_interval=0.2, stop_event=stop, progress=lines.append)))
    runner.start()
    try:
        deadline = time.monotonic() + 20
        while not lines and time.monotonic() < deadline:
            time.sleep(0.01)
        port = re.search(r"listening on http 127\.0\.0\.1:(\d+)", lines[0]).group(1)
        endpoint = f"http://127.0.0.1:{port}"
        env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
               "COLUMNS": "100"}
        out = tmp_path / "demo-out"
        proc = subprocess.run([sys.executable, "-m", "otel_kvtrace.cli", "demo", "--preset", "hol", "--steps", "3",
                               "--out", str(out)], capture_output=True, text=True, env=env, timeout=300, check=False)
    finally:
        stop.set()
        runner.join(20)
    text = " ".join(proc.stdout.split())
    assert proc.returncode == 0, proc.stderr
    assert f"the traces were sent to the OTLP endpoint {endpoint}" in text
    assert "Traces in" not in text and not (out / "traces").exists()
    (stats,) = result
    assert stats.http_requests > 0  # they really arrived there


def test_demo_out_defaults_from_the_config_module(tmp_path: Path, monkeypatch) -> None:
    from otel_kvtrace.demo import run_demo

    monkeypatch.setenv("OTEL_KVTRACE_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    result = run_demo("hol", steps=2)
    assert result.out_dir == tmp_path / "data"
    assert result.scenarios[0].trace_files and all(f.parent == tmp_path / "data" / "traces"
                                                   for f in result.scenarios[0].trace_files)
