"""A traced serving process dies through ``start_tracing``'s session, the path a real server takes: its exit
drain fits in ``OTEL_KVTRACE_EXIT_DRAIN_MS`` (the session uses the exporter's, or the agent's, at-exit path,
no extra grace), and a multiprocessing child leaving through ``os._exit`` releases the records it held for
a consumer wait before the drain, so they are exported rather than lost uncounted."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from fault_receivers import BlackHole

CHILD = Path(__file__).with_name("session_exit_child.py")
REPO = Path(__file__).resolve().parents[2]
DRAIN_S = 1.0
SLACK_S = 0.6
"""What a drain may take beyond its deadline (measured ~0.05 s): well under the 1 s grace it must not add."""
SUMMARY = re.compile(r"export summary: recorded=(\d+) delivered=(\d+) spooled=(\d+) dropped=(\d+) pending=(\d+) "
                     r"\(balanced\); exit drain deadline OTEL_KVTRACE_EXIT_DRAIN_MS=1000")


def _run(tmp_path: Path, args: list[str], **env: str) -> tuple[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OTEL_KVTRACE_EXPORT_INTERVAL_MS": "20",
           "OTEL_KVTRACE_EXIT_DRAIN_MS": str(int(DRAIN_S * 1000)), "OTEL_KVTRACE_EXPORT_TIMEOUT_MS": "60000",
           "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "60", "OTEL_KVTRACE_SPOOL_DIR": str(tmp_path / "spool"), **env}
    proc = subprocess.run([sys.executable, str(CHILD), *args], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, proc.stderr


@pytest.mark.parametrize("exporter", ["thread", "agent"])
@pytest.mark.parametrize("spool", [True, False], ids=["spool", "no-spool"])
def test_a_traced_process_exits_within_the_exit_deadline(tmp_path: Path, exporter: str, spool: bool) -> None:
    hole = BlackHole()
    try:
        out, log = _run(tmp_path, ["drain", hole.endpoint], OTEL_KVTRACE_EXPORTER=exporter,
                        OTEL_KVTRACE_SPOOL_MAX_MB="64" if spool else "0")
    finally:
        hole.stop()
    stamps = dict(line.split() for line in out.splitlines())
    took = float(stamps["exited"]) - float(stamps["exiting"])  # the child's own clock around its drain
    print(f"{exporter} spool={spool}: exit drain took {took:.3f} s (deadline {DRAIN_S} s)")
    assert took < DRAIN_S + SLACK_S, log
    if exporter == "thread":  # the in-process exporter's summary says where every task is
        (match,) = SUMMARY.findall(log)
        recorded, delivered, spooled, dropped, pending = map(int, match)
        assert recorded > 0 and delivered == 0 and pending == 0
        assert (spooled, dropped) == ((recorded, 0) if spool else (0, recorded))


def test_a_multiprocessing_child_releases_held_records_at_os_exit(tmp_path: Path) -> None:
    out, log = _run(tmp_path, ["mp", str(tmp_path)], OTEL_KVTRACE_EXPORTER="thread")
    submitted = int(out.split()[2])  # before the exit: the held records are not submitted yet
    roots = []
    for path in (tmp_path / "traces").glob("*.jsonl"):
        for line in path.read_bytes().splitlines():
            for rs in orjson.loads(line)["resourceSpans"]:
                roots += [s for ss in rs["scopeSpans"] for s in ss["spans"] if not s.get("parentSpanId")]
    recv = [s for s in roots if s["name"] == "kvtrace.recv.task"]
    reasons = [a["value"]["stringValue"] for s in recv for a in s["attributes"]
               if a["key"] == "kvtrace.consumer_wait_missing"]
    assert len(recv) >= 4 and reasons == ["shutdown"] * len(recv), log
    summaries = re.findall(r"export summary: recorded=(\d+) delivered=(\d+) spooled=0 dropped=0 pending=0 "
                           r"\(balanced\)", log)
    assert [int(d) for r, d in summaries if int(r)] == [len(roots)] and len(roots) > submitted, log
