"""The exporter agent's CPU policy, read back from the real agent process (``OTEL_KVTRACE_AGENT_SCHED``,
``_NICE``, ``_CPUS``) and its switch out of ``SCHED_IDLE`` while the ring backs up."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from otel_kvtrace import config
from otel_kvtrace.export.agent_link import AgentExporter
from otel_kvtrace.record import ring as R
from otel_kvtrace.record.recorder import Recorder

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE") or not hasattr(os, "memfd_create"),
                                reason="Linux scheduling policies and memfd")


def _agent(tmp_path: Path) -> tuple[AgentExporter, int]:
    exporter = AgentExporter(Recorder(), {"service.name": "priority-test"}, out_dir=tmp_path)
    return exporter, int(exporter.writer.hdr[R.H_AGENT_PID])


def _policy_line(pid: int) -> int:
    sched = Path(f"/proc/{pid}/sched").read_text()
    return int(sched.split("\npolicy", 1)[1].split(":", 1)[1].split()[0])


def test_the_agent_runs_sched_idle_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(config.OTEL_KVTRACE_AGENT_SCHED, raising=False)
    exporter, pid = _agent(tmp_path)
    try:
        assert os.sched_getscheduler(pid) == os.SCHED_IDLE
        assert _policy_line(pid) == os.SCHED_IDLE
        assert os.sched_getscheduler(os.getpid()) == os.SCHED_OTHER  # the serving process is untouched
    finally:
        exporter.shutdown()


def test_normal_keeps_the_nice_level_and_cpus_pin_the_agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = max(os.sched_getaffinity(0))
    monkeypatch.setenv(config.OTEL_KVTRACE_AGENT_SCHED, "normal")
    monkeypatch.setenv(config.OTEL_KVTRACE_AGENT_NICE, "7")
    monkeypatch.setenv(config.OTEL_KVTRACE_AGENT_CPUS, str(cpu))
    exporter, pid = _agent(tmp_path)
    try:
        assert os.sched_getscheduler(pid) == os.SCHED_OTHER
        assert os.getpriority(os.PRIO_PROCESS, pid) - os.getpriority(os.PRIO_PROCESS, 0) == 7
        assert os.sched_getaffinity(pid) == {cpu}
        assert os.sched_getaffinity(0) != {cpu} or len(os.sched_getaffinity(0)) == 1  # ours is not narrowed
    finally:
        exporter.shutdown()


@pytest.mark.parametrize(("raw", "want"), [("", None), ("3", (3,)), ("0-2, 5", (0, 1, 2, 5)), ("2-1", None),
                                           ("a", None), ("-1", None)])
def test_agent_cpus_parse_or_warn_once(raw: str, want: tuple[int, ...] | None,
                                       caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="otel_kvtrace"):
        assert config.agent_cpus({config.OTEL_KVTRACE_AGENT_CPUS: raw}) == want
    assert len(caplog.records) == (1 if raw and want is None else 0)


def test_an_unknown_policy_warns_and_runs_idle(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="otel_kvtrace"):
        assert config.agent_sched({config.OTEL_KVTRACE_AGENT_SCHED: "fifo"}) == config.AGENT_SCHED_IDLE
        assert config.agent_sched({config.OTEL_KVTRACE_AGENT_SCHED: " Normal "}) == config.AGENT_SCHED_NORMAL
    assert len(caplog.records) == 1


_SWITCH = """
import os, threading
from otel_kvtrace.export.agent import Priority
p = Priority("idle", 10, None)
p.apply()
t = threading.Thread(target=threading.Event().wait, args=(30,), daemon=True)
t.start()  # started idle: inherits SCHED_IDLE; switched with the main thread below
def policies():
    return sorted({os.sched_getscheduler(int(tid)) for tid in os.listdir("/proc/self/task")})
out = [policies()]
p.update(600, 1000)   # more than half the ring: leave SCHED_IDLE (every thread)
out.append(policies())
p.update(200, 1000)   # still a backlog above an eighth: stay
out.append(policies())
p.update(125, 1000)   # down to an eighth: idle again
out.append(policies())
print(out, p.escalations)
"""


def test_a_backed_up_ring_takes_the_agent_out_of_sched_idle_and_back() -> None:
    """In a real child process (the switch applies to every thread of the process that runs it)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", _SWITCH], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    idle, other = os.SCHED_IDLE, os.SCHED_OTHER
    assert out.stdout.strip() == f"{[[idle], [other], [other], [idle]]} 1", out.stdout
