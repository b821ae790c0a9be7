"""`kvtrace async doctor` against real child processes started with chosen environments and arguments."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner

from otel_kvtrace.asynccheck.cli import async_group
from otel_kvtrace.asynccheck.doctor import ERROR, OK, WARN, DoctorError, doctor


@contextmanager
def child(args: Sequence[str], env: dict[str, str]) -> Iterator[int]:
    """A sleeping Python child with ``args`` after ``-c`` and exactly ``env`` (plus PATH)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(30)", *args],
        env={"PATH": os.environ.get("PATH", ""), **env},
    )
    try:
        deadline = time.monotonic() + 10
        while not Path(f"/proc/{proc.pid}/cmdline").read_bytes() and time.monotonic() < deadline:
            time.sleep(0.01)  # cmdline is empty until exec completes
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def _status(report, key: str) -> str:  # noqa: ANN001
    return next(f.status for f in report.findings if f.key == key)


def test_live_process_with_blocking_settings(tmp_path: Path) -> None:
    env = {"MINDIE_ASYNC_SCHEDULING_ENABLE": "1", "TASK_QUEUE_ENABLE": "0", "ASCEND_LAUNCH_BLOCKING": "1"}
    with child(["--async-scheduling"], env) as pid:
        report = doctor(pid=pid)
    assert "--async-scheduling" in report.argv
    assert _status(report, "MINDIE_ASYNC_SCHEDULING_ENABLE") == OK
    assert _status(report, "TASK_QUEUE_ENABLE") == ERROR
    assert _status(report, "ASCEND_LAUNCH_BLOCKING") == ERROR
    assert _status(report, "--async-scheduling") == OK
    assert report.findings[0].status == ERROR  # worst first
    assert all(f.fix for f in report.findings if f.status in (ERROR, WARN))
    assert report.versions_from == sys.executable  # the child's own interpreter, as invoked
    assert set(report.versions) >= {"vllm", "vllm-ascend", "torch-npu"}
    # read by the child's interpreter inside its virtualenv, where this package is installed
    assert report.versions["otel-kvtrace"] == importlib.metadata.version("otel-kvtrace")


def test_live_process_recommended_settings() -> None:
    with child(["vllm", "serve", "m"], {"TASK_QUEUE_ENABLE": "2"}) as pid:
        report = doctor(pid=pid)
    assert _status(report, "TASK_QUEUE_ENABLE") == OK
    assert _status(report, "ASCEND_LAUNCH_BLOCKING") == OK
    # vLLM without the flag: resolved at start-up, the doctor says how to confirm it
    assert "Asynchronous scheduling is enabled" in next(f.fix for f in report.findings if f.key == "--async-scheduling")


def test_no_async_flag_and_splitfuse_conflict(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text('{"ModelDeployConfig": {"ModelConfig": [{"plugin_params": "{\\"plugin_type\\":\\"splitfuse\\"}"}]}}')
    env = {"MINDIE_ASYNC_SCHEDULING_ENABLE": "1", "MIES_CONFIG_JSON_PATH": str(config)}
    with child(["vllm", "serve", "m", "--async-scheduling", "--no-async-scheduling"], env) as pid:
        report = doctor(pid=pid)
    assert _status(report, "--async-scheduling") == ERROR  # the last flag wins
    assert _status(report, "splitfuse") == WARN


def test_missing_pid_is_a_clear_error_with_exit_2() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # reaped: the PID no longer exists
    with pytest.raises(DoctorError, match=f"--pid {proc.pid}: no such process"):
        doctor(pid=proc.pid)
    result = CliRunner().invoke(async_group, ["doctor", "--pid", str(proc.pid)])
    assert result.exit_code == 2
    assert "no such process" in result.output


def test_pid_and_cmdline_together_is_an_error() -> None:
    result = CliRunner().invoke(async_group, ["doctor", "--pid", "1", "--cmdline", "vllm serve m"])
    assert result.exit_code == 2
    assert "exactly one of --pid or --cmdline" in result.output


def test_cmdline_env_file_and_log(tmp_path: Path) -> None:
    env_file = tmp_path / "deploy.env"
    env_file.write_text("# deployment\nexport TASK_QUEUE_ENABLE=2\nMINDIE_ASYNC_SCHEDULING_ENABLE='1'\n")
    log = tmp_path / "server.log"
    log.write_text(
        "[INFO] generator.py:323 Async inference is activated.\n"
        "[INFO] llm_engine.cpp Response and schedule transfer cost too long. response cost:3, scheduleCost:9\n"
    )
    out = tmp_path / "doctor.json"
    result = CliRunner().invoke(
        async_group,
        ["doctor", "--cmdline", "mindieservice_daemon", "--env-file", str(env_file), "--log", str(log),
         "--json", str(out)],
    )
    assert result.exit_code == 0, result.output
    doc = orjson.loads(out.read_bytes())
    statuses = {f["key"]: f["status"] for f in doc["findings"]}
    assert statuses["TASK_QUEUE_ENABLE"] == OK
    assert statuses["log:mindie_python_async"] == OK
    assert statuses["log:mindie_partial"] == WARN  # no "Scheduler enable async." line
    assert statuses["log:mindie_schedule_cost"] == WARN
    assert [m["line"] for m in doc["log_matches"]] == [1, 2]


def test_vllm_log_line_confirms(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    log.write_text("INFO 01-01 [vllm.py:790] Asynchronous scheduling is enabled.\n")
    report = doctor(cmdline="vllm serve m", log=log)
    assert _status(report, "log:vllm_async_enabled") == OK


def test_bad_env_file_line_names_the_option(tmp_path: Path) -> None:
    env_file = tmp_path / "bad.env"
    env_file.write_text("JUSTAWORD\n")
    with pytest.raises(DoctorError, match=r"--env-file .*bad.env:1: expected KEY=VALUE"):
        doctor(cmdline="vllm serve m", env_file=env_file)


def _doctor_error_as(uid: int | None, pid: int) -> str:
    """Run ``doctor(pid=...)`` in a forked child, as ``uid`` when given; return the DoctorError text."""
    read_fd, write_fd = os.pipe()
    child_pid = os.fork()
    if child_pid == 0:  # pragma: no cover - runs in the forked child
        try:
            if uid is not None:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            doctor(pid=pid)
            message = "no error"
        except DoctorError as exc:
            message = str(exc)
        except BaseException as exc:  # noqa: BLE001
            message = f"unexpected {type(exc).__name__}: {exc}"
        os.write(write_fd, message.encode())
        os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as fh:
        message = fh.read().decode()
    os.waitpid(child_pid, 0)
    return message


def test_unreadable_process_is_a_clear_permission_error() -> None:
    if os.geteuid() == 0:
        # a root-owned child, inspected by an unprivileged user: /proc/PID/environ is 0400 root
        with child([], {}) as pid:
            message = _doctor_error_as(65534, pid)
    else:
        message = _doctor_error_as(None, 1)  # PID 1 belongs to root
    assert "permission denied" in message, message
    assert "--pid" in message
