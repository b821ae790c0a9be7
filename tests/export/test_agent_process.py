"""Real serving processes (the threaded replica, traced through the exporter agent) and real signals.

SIGKILL and SIGTERM mid-run: every task handed to the ring before the last progress line the serving
process printed is in the trace files (the agent drains the ring after its producer died); what the
agent could not decode is counted in the ring header. A driver that never calls
``wait_for_layer_load`` still exports its tasks, flagged with why their consumer wait is absent. A forked
child gets its own ring and agent and exports to its own file.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

CHILD = Path(__file__).with_name("agent_child.py")
REPO = Path(__file__).resolve().parents[2]


def _start(out: Path, *args: str, exporter: str = "agent", new_group: bool = False) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OTEL_KVTRACE_EXPORT_INTERVAL_MS": "20",
           "OTEL_KVTRACE_EXPORTER": exporter}
    return subprocess.Popen([sys.executable, str(CHILD), str(out), *args], stdout=subprocess.PIPE, text=True,
                            env=env, start_new_session=new_group)


def _roots(out: Path) -> list[dict]:
    roots = []
    for path in sorted((out / "traces").glob("*.jsonl")):
        for line in path.read_bytes().splitlines():
            for rs in orjson.loads(line)["resourceSpans"]:
                for ss in rs["scopeSpans"]:
                    for span in ss["spans"]:
                        if not span.get("parentSpanId"):
                            span["file"] = path.name
                            roots.append(span)
    return roots


def _attr(span: dict, key: str) -> object:
    for a in span["attributes"]:
        if a["key"] == key:
            return next(iter(a["value"].values()))
    return None


def _wait_gone(pid: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "Z":
                    return
        except FileNotFoundError:
            return
        time.sleep(0.02)
    raise AssertionError(f"agent {pid} still running {timeout_s} s after its producer died")


@pytest.mark.parametrize(("sig", "group"), [(signal.SIGKILL, False), (signal.SIGTERM, False), (signal.SIGTERM, True)],
                         ids=["SIGKILL", "SIGTERM", "SIGTERM-to-process-group"])
def test_signal_mid_run_loses_only_tasks_in_flight(tmp_path: Path, sig: signal.Signals, group: bool) -> None:
    """``group``: the signal goes to the serving process's whole process group, as Ctrl-C, `kill -- -PGID`
    and container runtimes send it; the agent is in that group and must outlive its producer to drain."""
    proc = _start(tmp_path, "run", new_group=group)
    assert proc.stdout is not None
    ready = proc.stdout.readline().split()
    assert ready[0] == "ready" and int(ready[1]) > 0, ready
    agent_pid = int(ready[1])
    submitted = 0
    for line in proc.stdout:
        step, n = int(line.split()[1]), int(line.split()[2])
        submitted = n
        if step == 12:
            if group:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)
            break
    proc.wait(10)
    _wait_gone(agent_pid)
    roots = _roots(tmp_path)
    assert submitted > 0
    # Everything shipped before the last progress line, at most what was in flight more (one step).
    assert submitted <= len(roots) <= submitted + 40
    assert len({_attr(r, "kvtrace.correlation_id") for r in roots}) == len(roots)  # no duplicates
    assert {r["file"] for r in roots} == {f"kvtrace-agent-run-{proc.pid}.jsonl"}


@pytest.mark.parametrize(
    ("how", "exporter", "reason"),
    [("exit", "agent", "producer_died"), ("normal", "agent", "shutdown"), ("normal", "thread", "shutdown")],
)
def test_driver_without_wait_for_layer_load_still_exports(tmp_path: Path, how: str, exporter: str,
                                                          reason: str) -> None:
    proc = _start(tmp_path, "nowait", how, exporter=exporter)
    out, _ = proc.communicate(timeout=60)
    lines = out.splitlines()
    agent_pid = int(lines[0].split()[1])
    submitted = int(lines[1].split()[2])
    if exporter == "agent":
        _wait_gone(agent_pid)
    roots = _roots(tmp_path)
    recv = [r for r in roots if r["name"] == "kvtrace.recv.task"]
    # (in-process, held records count as submitted only once released at exit)
    assert (len(roots) == submitted if exporter == "agent" else len(roots) > submitted) and len(recv) >= 4
    assert [_attr(r, "kvtrace.consumer_wait_missing") for r in recv] == [reason] * len(recv)


@pytest.mark.parametrize("how", ["normal", "exit"])
def test_forked_child_exports_through_its_own_agent(tmp_path: Path, how: str) -> None:
    proc = _start(tmp_path, "fork", how)
    out, _ = proc.communicate(timeout=120)
    lines = dict((line.split()[0], line.split()[1:]) for line in out.splitlines())
    child_pid, child_submitted = int(lines["child"][0]), int(lines["child"][1])
    child_agent = int(lines["child"][2])
    assert child_submitted > 0 and lines["parent"][2] == "0"
    assert child_agent != int(lines["ready"][0])  # its own agent, not the parent's
    _wait_gone(child_agent)
    roots = _roots(tmp_path)
    child_file = f"kvtrace-agent-fork-{child_pid}.jsonl"
    assert sum(1 for r in roots if r["file"] == child_file) == child_submitted
    assert all(r["file"] == child_file for r in roots)  # the parent recorded nothing


def test_a_dead_agent_never_blocks_the_serving_threads(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from otel_kvtrace.api import start_tracing
    from otel_kvtrace.demo import scenario_configs
    from otel_kvtrace.export.agent_link import AgentExporter
    from otel_kvtrace.export.worker import build_resource
    from otel_kvtrace.record import ring as R
    from otel_kvtrace.replica.threaded import replica_targets, run_threaded

    ((_, cfg),) = scenario_configs("hol", steps=20)
    reference = start_tracing(replica_targets(cfg.behaviour), exporter=None, run_id="dead-agent-ref")
    run_threaded(cfg)
    all_tasks = reference.shutdown().submitted  # tasks of the complete run (in-process, nothing dropped)
    session = start_tracing(replica_targets(cfg.behaviour), exporter=None, run_id="dead-agent")
    exporter = AgentExporter(session.recorder, build_resource({}), out_dir=tmp_path, nslots=R.CLAIM_MARGIN + 64)
    os.kill(int(exporter.writer.hdr[R.H_AGENT_PID]), signal.SIGKILL)
    try:
        with caplog.at_level("WARNING", logger="otel_kvtrace"):
            result = run_threaded(cfg)
    finally:
        stats = session.shutdown()
        exporter.shutdown(1.0)
    assert result.error is None and result.clean_shutdown and stats.disabled_reason is None
    recorder = session.recorder
    assert recorder.submitted <= 64 and recorder.dropped > 0  # the ring filled, the rest was counted
    assert recorder.submitted + recorder.dropped == all_tasks  # every task written or counted
    assert [r.message for r in caplog.records if "ring full" in r.message] and \
        len([r for r in caplog.records if "ring full" in r.message]) == 1


def test_a_shut_down_agent_exporter_and_its_ring_are_freed(tmp_path: Path) -> None:
    import gc
    import weakref

    from otel_kvtrace.export.agent_link import AgentExporter
    from otel_kvtrace.export.worker import build_resource
    from otel_kvtrace.record.recorder import Recorder

    recorder = Recorder()
    exporter = AgentExporter(recorder, build_resource({}), out_dir=tmp_path)
    ring = weakref.ref(exporter.writer)
    assert recorder.ring is exporter.writer
    exporter.shutdown()
    assert recorder.ring is None and exporter.lost == 0 and exporter.force_flush()
    ref = weakref.ref(exporter)
    del exporter
    gc.collect()
    assert ref() is None and ring() is None  # no at-fork or atexit hook keeps 8 MiB per session alive


def test_without_an_agent_tracing_falls_back_to_the_in_process_exporter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from otel_kvtrace.api import start_tracing
    from otel_kvtrace.demo import scenario_configs
    from otel_kvtrace.export import agent_link
    from otel_kvtrace.export.worker import BackgroundExporter
    from otel_kvtrace.replica.threaded import replica_targets, run_threaded

    monkeypatch.setattr(agent_link, "AGENT_MODULE", "otel_kvtrace.no_such_agent")  # the agent dies at start
    ((_, cfg),) = scenario_configs("hol", steps=3)
    with caplog.at_level("WARNING", logger="otel_kvtrace"):
        session = start_tracing(replica_targets(cfg.behaviour), out_dir=tmp_path, run_id="fallback")
    try:
        assert run_threaded(cfg).error is None
    finally:
        stats = session.shutdown()
    assert isinstance(session.exporter, BackgroundExporter) and session.recorder.ring is None
    assert len([r for r in caplog.records if "exporter agent unavailable" in r.message]) == 1
    assert stats.dropped == 0 and len(_roots(tmp_path)) == stats.submitted > 0


def _slow_receiver_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, margin_s: float | None) -> tuple:
    """An agent exporting to a real gRPC receiver that takes 2.5 s per request, shut down with 1 s."""
    from export_records import fill_record
    from fault_receivers import GrpcReceiver

    from otel_kvtrace.export import agent_link
    from otel_kvtrace.export.worker import build_resource
    from otel_kvtrace.record.recorder import Recorder

    monkeypatch.setenv("OTEL_KVTRACE_EXPORT_TIMEOUT_MS", "1000")
    monkeypatch.setenv("OTEL_KVTRACE_SPOOL_DIR", str(tmp_path / "spool"))
    if margin_s is not None:
        monkeypatch.setattr(agent_link, "SHUTDOWN_MARGIN_S", margin_s, raising=False)
    receiver = GrpcReceiver(sleep_s=2.5)
    try:
        recorder = Recorder()
        exporter = agent_link.AgentExporter(recorder, build_resource({}), endpoint=receiver.endpoint,
                                            protocol="grpc")
        for i in range(200):
            rec = recorder.new_record()
            fill_record(rec, seq=i)
            recorder.submit(rec)
        start = time.monotonic()
        finished = exporter.shutdown()
        took = time.monotonic() - start
        return finished, exporter.stats(), took
    finally:
        receiver.stop()


def test_a_slow_receiver_leaves_the_agent_time_to_settle_its_sink(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                   ) -> None:
    finished, stats, took = _slow_receiver_run(tmp_path, monkeypatch, None)
    assert finished, stats  # not killed: its sink's final counts reached the header
    assert stats.balanced and stats.pending == 0 and stats.recorded == 200, stats
    assert stats.delivered + stats.spooled == 200, stats


def test_an_agent_killed_at_shutdown_leaves_nothing_pending(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    finished, stats, took = _slow_receiver_run(tmp_path, monkeypatch, 0.0)  # no margin: killed mid-delivery
    assert not finished
    assert stats.balanced and stats.pending == 0 and stats.recorded == 200, stats


def test_a_forked_child_closes_its_copies_of_the_parent_agents_pipes(tmp_path: Path) -> None:
    """Closed through their file objects: a bare ``os.close`` left them open, and their later garbage
    collection closed the same fd numbers again, by then the child's own ring or agent pipes."""
    from otel_kvtrace.export.agent_link import AgentExporter
    from otel_kvtrace.export.worker import build_resource
    from otel_kvtrace.record.recorder import Recorder

    exporter = AgentExporter(Recorder(), build_resource({}), out_dir=tmp_path)
    parent_agent = exporter._proc
    assert parent_agent is not None
    try:
        pid = os.fork()
        if pid == 0:  # the child: the at-fork hook has run
            ok = parent_agent.stdin.closed and parent_agent.stdout.closed and exporter._proc is not parent_agent
            exporter.shutdown(5.0)
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        exporter.shutdown()


def test_force_flush_on_the_cpu_waits_for_the_agent_and_gives_up_at_its_deadline(tmp_path: Path) -> None:
    """``poll_s=0`` (a benchmark that must not leave the CPU between chunks): returns once the agent has
    exported every task written, and False at the deadline when the agent cannot drain (stopped)."""
    from export_records import fill_record

    from otel_kvtrace.export.agent_link import AgentExporter
    from otel_kvtrace.export.worker import build_resource
    from otel_kvtrace.record import ring as R
    from otel_kvtrace.record.recorder import Recorder

    recorder = Recorder()
    exporter = AgentExporter(recorder, build_resource({}), out_dir=tmp_path)
    hdr = exporter.writer.hdr

    def write(n: int, start: int) -> None:
        for i in range(start, start + n):
            rec = recorder.new_record()
            fill_record(rec, seq=i)
            recorder.submit(rec)

    try:
        write(50, 0)
        assert exporter.force_flush(30.0, poll_s=0) and hdr[R.H_READ] >= hdr[R.H_HEAD]
        os.kill(exporter._proc.pid, signal.SIGSTOP)
        try:
            write(50, 50)
            start = time.monotonic()
            assert not exporter.force_flush(0.3, poll_s=0)
            assert time.monotonic() - start < 5.0 and hdr[R.H_READ] < hdr[R.H_HEAD]
        finally:
            os.kill(exporter._proc.pid, signal.SIGCONT)
        assert exporter.force_flush(30.0, poll_s=0)
    finally:
        exporter.shutdown()
    assert exporter.stats().recorded == 100
