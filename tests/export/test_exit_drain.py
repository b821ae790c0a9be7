"""The drain at process exit has its own short deadline (``OTEL_KVTRACE_EXIT_DRAIN_MS``): a real process
dying with an endpoint that accepts TCP and never answers exits after about that deadline, not after the
export timeout, and every task it recorded is delivered, in the spool on disk (resend command logged) or
counted as dropped: ``delivered + spooled + dropped == recorded``, read from its files and its log."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from fault_receivers import BlackHole
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from otel_kvtrace.export.sinks import RETRY, Attempt, OtlpHttpSink

CHILD = Path(__file__).with_name("exit_drain_child.py")
TASKS = 600
DRAIN_S = 1.0
EXPORT_TIMEOUT_S = 60
"""The export timeout (and the OTLP client's): what a dying process waited before the exit deadline."""
SUMMARY = re.compile(r"export summary: recorded=(\d+) delivered=(\d+) spooled=(\d+) dropped=(\d+) pending=(\d+) "
                     r"\(balanced\); exit drain deadline OTEL_KVTRACE_EXIT_DRAIN_MS=1000")


def _die(tmp_path: Path, endpoint: str, protocol: str, how: str, spool: bool) -> tuple[float, str]:
    """Run the child; seconds from its "exiting" line to its end, and its log."""
    env = {**os.environ, "OTEL_KVTRACE_EXIT_DRAIN_MS": str(int(DRAIN_S * 1000)),
           "OTEL_KVTRACE_EXPORT_TIMEOUT_MS": str(EXPORT_TIMEOUT_S * 1000),
           "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": str(EXPORT_TIMEOUT_S),
           "OTEL_KVTRACE_SPOOL_DIR": str(tmp_path / "spool"), "OTEL_KVTRACE_SPOOL_MAX_MB": "64" if spool else "0"}
    proc = subprocess.Popen([sys.executable, str(CHILD), endpoint, protocol, str(TASKS), how], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "exiting"
        started = time.monotonic()
        _, log = proc.communicate(timeout=3 * EXPORT_TIMEOUT_S)
        return time.monotonic() - started, log
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("how", ["exit", "mp"])
@pytest.mark.parametrize(("protocol", "spool"), [("http/protobuf", True), ("grpc", True), ("http/protobuf", False)],
                         ids=["http-spool", "grpc-spool", "http-no-spool"])
def test_a_dying_process_drains_within_the_exit_deadline(tmp_path: Path, how: str, protocol: str, spool: bool) -> None:
    hole = BlackHole()
    try:
        elapsed, log = _die(tmp_path, hole.endpoint, protocol, how, spool)
    finally:
        hole.stop()
    print(f"{how} {protocol} spool={spool}: exit took {elapsed:.2f} s (deadline {DRAIN_S} s, export timeout "
          f"{EXPORT_TIMEOUT_S} s)")
    # it waited for its deadline (sending, or for the stuck exporter), then died: not the export timeout
    # (the lower bound is halved: this process may read the "exiting" line late on a loaded machine)
    assert DRAIN_S / 2 <= elapsed < EXPORT_TIMEOUT_S / 4, log
    (match,) = SUMMARY.findall(log)
    recorded, delivered, spooled, dropped, pending = map(int, match)
    assert recorded == delivered + spooled + dropped and pending == 0
    assert (recorded, delivered) == (TASKS, 0)
    spool_dirs = [p for p in (tmp_path / "spool").glob("*") if p.is_dir()]
    if spool:  # nothing lost: every task is on disk, and the log says how to send it
        assert (spooled, dropped) == (TASKS, 0)
        (command,) = re.findall(r"Resend with: (kvtrace resend \S+ --endpoint \S+ --protocol \S+)", log)
        (directory,) = spool_dirs
        assert command.split()[2] == str(directory)
        assert sum(int(p.name.split("-t")[1].split(".")[0]) for p in directory.glob("*.jsonl")) == TASKS
    else:  # no spool: what the stuck exporter held and what was still pending is counted as dropped
        assert (spooled, dropped) == (0, TASKS)
        assert spool_dirs == []


def test_an_http_attempt_ends_when_aborted_not_at_the_client_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sender's POST to an endpoint that never answers returns on ``abort`` (shutdown, the exit
    deadline), as a gRPC call does, instead of holding the sender for the client's whole timeout."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", str(EXPORT_TIMEOUT_S))
    hole = BlackHole()
    try:
        sink = OtlpHttpSink({"kvtrace.run_id": "exit-drain"}, hole.endpoint)
        abort, out = threading.Event(), []
        sender = threading.Thread(target=lambda: out.append(sink.attempt(ExportTraceServiceRequest(), abort)))
        sender.start()
        while not hole.conns:  # the request reached the receiver, which will never answer
            sender.join(0.02)
        assert sender.is_alive()
        abort.set()
        sender.join(EXPORT_TIMEOUT_S / 4)
        assert not sender.is_alive(), "the attempt waited for the client timeout"
        assert out == [Attempt(RETRY, "aborted at shutdown")]
        sink.shutdown()
    finally:
        hole.stop()
