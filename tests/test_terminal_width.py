"""`COLUMNS=80 kvtrace whatif ...` and `kvtrace sweep --report`, piped: no line over 80 characters and
nothing cut to `…` (headers, values, verdicts). `kvtrace report` has its own test in
tests/analysis/test_report.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from otel_kvtrace.demo import run_demo


def _kvtrace(cwd: Path, *args: str) -> str:
    """Run in ``cwd`` with relative paths: a path printed for copy-paste is not wrapped, so a long
    temporary directory would say nothing about the layout."""
    env = {**os.environ, "COLUMNS": "80"}
    proc = subprocess.run([sys.executable, "-m", "otel_kvtrace.cli", *args], capture_output=True, text=True,
                          env=env, timeout=600, check=False, cwd=cwd)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _assert_fits(text: str) -> None:
    lines = text.splitlines()
    assert lines and max(len(line) for line in lines) <= 80, max(lines, key=len)
    assert "…" not in text


@pytest.mark.slow
def test_whatif_and_sweep_fit_80_columns(tmp_path: Path) -> None:
    demo = run_demo("both", steps=10, out=tmp_path / "demo")
    out = _kvtrace(tmp_path, "whatif", "demo/traces")
    _assert_fits(out)
    assert "verdict" in out and "keep FIFO" in out  # the verdict is there, whole
    out = _kvtrace(tmp_path, "sweep", "--quick", "--out", "sw", "--report")
    _assert_fits(out)
    assert "Coverage sweep" in out
