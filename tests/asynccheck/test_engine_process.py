"""The engine-core process forked or spawned from the plugin-loaded process writes its own trace.

Real processes (``engine_process``): the parent installs as the vLLM plugin does, the child runs the
real vLLM 0.33 engine loop and exits through multiprocessing's ``os._exit`` (no ``atexit``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from otel_kvtrace.asynccheck import analysis

from .engine_process import STEPS
from .vllm_src import vllm_source

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_engine_core_child_writes_its_trace(tmp_path: Path, method: str) -> None:
    vllm_source("0.33.0")  # fetched (once) outside the timed child
    out = tmp_path / "data" / "async"
    env = dict(os.environ, OTEL_KVTRACE_ENABLED="1", OTEL_KVTRACE_RUN_ID="../../escape")
    proc = subprocess.run([sys.executable, "-m", "tests.asynccheck.engine_process", method, str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    child_pid, exitcode = proc.stdout.split()
    assert exitcode == "0", proc.stderr[-2000:]
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    # the run id cannot move the file out of the data directory, and only the engine process wrote one
    assert [p.parent for p in files] == [out]
    assert [p.name for p in files] == [f"kvtrace-async-_.._escape-{child_pid}.jsonl"]
    result = analysis.check(files)
    assert result.metrics.steps >= STEPS
    assert result.verdict == analysis.EFFECTIVE, result.reasons
