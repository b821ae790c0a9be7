"""A real `kvtrace serve-replica` process on a free loopback port."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def serve_replica(data_dir: Path, *args: str) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """Start the server, yield (base_url, process); SIGTERM it at the end (if still running)."""
    env = dict(os.environ)
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    env.pop("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "otel_kvtrace.cli", "serve-replica", "--port", "0", "--data-dir", str(data_dir), *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        match = re.search(r"http://127\.0\.0\.1:\d+", line)
        assert match, f"no listening line: {line!r} {proc.stderr.read() if proc.poll() is not None else ''}"
        yield match.group(0), proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture()
def server(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[str], Path]]:
    with serve_replica(tmp_path / "data") as (url, proc):
        yield url, proc, tmp_path / "data"


def wait_exit(proc: subprocess.Popen[str], timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc.wait(1)
