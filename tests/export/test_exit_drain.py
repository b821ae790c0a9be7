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
SLACK_S = 0.9
"""What a drain may take beyond its deadline (measured ~0.05 s idle, 0.604 s once on a loaded 2-core
machine): still under the 1 s grace of a normal shutdown, which the exit path must not add."""
EXPORT_TIMEOUT_S = 60
"""The export timeout (and the OTLP client's): what a dying process waited before the exit deadline."""
SUMMARY = (r"export summary: recorded=(\d+) delivered=(\d+) spooled=(\d+) dropped=(\d+) pending=(\d+) "
           r"\(balanced\); exit drain deadline OTEL_KVTRACE_EXIT_DRAIN_MS={}")


def _die(tmp_path: Path, endpoint: str, protocol: str, how: str, spool: bool,
         drain_s: float = DRAIN_S) -> tuple[float, str]:
    """Run the child; seconds its drain took (its own clock: from "exiting" to "exited"), and its log."""
    env = {**os.environ, "OTEL_KVTRACE_EXIT_DRAIN_MS": str(int(drain_s * 1000)),
           "OTEL_KVTRACE_EXPORT_TIMEOUT_MS": str(EXPORT_TIMEOUT_S * 1000),
           "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": str(EXPORT_TIMEOUT_S),
           "OTEL_KVTRACE_SPOOL_DIR": str(tmp_path / "spool"), "OTEL_KVTRACE_SPOOL_MAX_MB": "64" if spool else "0"}
    proc = subprocess.Popen([sys.executable, str(CHILD), endpoint, protocol, str(TASKS), how], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, log = proc.communicate(timeout=3 * EXPORT_TIMEOUT_S)
        stamps = dict(line.split() for line in out.splitlines())
        return float(stamps["exited"]) - float(stamps["exiting"]), log
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
    # (that it waited at all shows in the summary: the tasks are spooled or dropped, none delivered)
    assert elapsed < DRAIN_S + SLACK_S, log
    (match,) = re.findall(SUMMARY.format(1000), log)
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
        deadline = time.monotonic() + EXPORT_TIMEOUT_S / 4
        while not hole.conns and time.monotonic() < deadline:  # the request reached the receiver, which
            sender.join(0.02)  # will never answer
        assert hole.conns, f"the request never reached the receiver: {out}"
        assert sender.is_alive()
        abort.set()
        sender.join(EXPORT_TIMEOUT_S / 4)
        assert not sender.is_alive(), "the attempt waited for the client timeout"
        assert out == [Attempt(RETRY, "aborted at shutdown")]
        sink.shutdown()
    finally:
        hole.stop()


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_a_zero_exit_deadline_spools_everything_pending(tmp_path: Path, protocol: str) -> None:
    """``OTEL_KVTRACE_EXIT_DRAIN_MS=0`` with a spool: every task still in the recorder at exit is written
    to the spool (a local write, not bounded by the deadline), none is dropped, none waited for."""
    hole = BlackHole()
    try:
        elapsed, log = _die(tmp_path, hole.endpoint, protocol, "exit-now", True, drain_s=0.0)
    finally:
        hole.stop()
    print(f"{protocol}: exit drain took {elapsed:.2f} s (deadline 0)")
    assert elapsed < SLACK_S, log
    (match,) = re.findall(SUMMARY.format(0), log)
    assert tuple(map(int, match)) == (TASKS, 0, TASKS, 0, 0)
    (directory,) = (p for p in (tmp_path / "spool").glob("*") if p.is_dir())
    assert sum(int(p.name.split("-t")[1].split(".")[0]) for p in directory.glob("*.jsonl")) == TASKS
