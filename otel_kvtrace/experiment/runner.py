"""Run a matrix: per cell and run, start the server from the template, wait for health, load, stop.

Layout under ``--out DIR``::

    DIR/matrix.yaml                       the matrix as run
    DIR/cells/<cell_id>/cell.json         the cell's config and rendered command
    DIR/cells/<cell_id>/run-<k>/          data/ (traces, metrics, requests), load.json, server.log, status.json

``status.json`` says ``ok`` or ``failed`` (with the reason and the tail of the server log) and holds the
run's fingerprint (rendered command, env, load). A run whose status is ``ok`` with the same fingerprint is
skipped next time (resumable); failed runs, and runs of a cell whose command or load changed, run again. A server that fails to start
or dies mid-run fails that run and the experiment goes on. Ctrl-C stops the server it started.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from otel_kvtrace.experiment.matrix import Cell, Matrix

LOG_TAIL_LINES = 20
PORT_ATTEMPTS = 3


@dataclass(slots=True)
class RunOutcome:
    cell_id: str
    run: int
    status: str  # ok | failed | skipped
    reason: str = ""
    log_tail: str = ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_dir(out: Path, cell: Cell, run: int) -> Path:
    return out / "cells" / cell.cell_id / f"run-{run}"


def render(matrix: Matrix, cell: Cell, port: int, data_dir: Path, run_id: str) -> tuple[list[str], dict[str, str]]:
    """The server's argv and extra environment for one run. The template is split like a shell line first,
    then each word is formatted, so a value with spaces or quotes stays one argument."""
    values: dict[str, Any] = {"port": port, "data_dir": str(data_dir), "run_id": run_id,
                              "kv_transfer_config": matrix.kv_config_json(cell), "concurrency": matrix.concurrency(cell),
                              "cell_id": cell.cell_id}
    values.update({k: ("" if v is None else v) for k, v in cell.values if k not in values})
    values.setdefault("scheduler", "fifo")
    try:
        words = shlex.split(matrix.command)
    except ValueError as exc:
        raise ValueError(f"server.command: not a shell-like command line ({exc})") from None
    try:
        argv = [w.format(**values) for w in words]
        env = {k: v.format(**values) for k, v in matrix.env.items()}
    except (KeyError, IndexError) as exc:
        raise ValueError(f"server.command: unknown placeholder {exc}; known: {sorted(values)}") from None
    if "kvtrace" in argv and shutil.which("kvtrace") is None:  # this interpreter's kvtrace
        i = argv.index("kvtrace")
        argv = [*argv[:i], sys.executable, "-m", "otel_kvtrace.cli", *argv[i + 1:]]
    return argv, env


def run_fingerprint(matrix: Matrix, cell: Cell, k: int) -> str:
    """What makes a run comparable on resume: the rendered command and env (port and paths left as
    placeholders), the load, and the run's seed. A stored run with another fingerprint is run again."""
    argv, env = render(matrix, cell, 0, Path("{data_dir}"), f"{cell.cell_id}-r{k}")
    doc = {"argv": argv, "env": env, "load": matrix.load, "concurrency": matrix.concurrency(cell),
           "health_path": matrix.health_path}
    return hashlib.sha256(orjson.dumps(doc, option=orjson.OPT_SORT_KEYS, default=str)).hexdigest()[:16]


def run_matrix(matrix: Matrix, out: Path, *, on_run: Callable[[RunOutcome], None] | None = None) -> list[RunOutcome]:
    """Every run of every cell; returns the outcomes in order (``skipped`` = already ok)."""
    out.mkdir(parents=True, exist_ok=True)
    if matrix.path.resolve() != (out / "matrix.yaml").resolve():
        shutil.copyfile(matrix.path, out / "matrix.yaml")
    outcomes = []
    for cell in matrix.cells:
        cdir = out / "cells" / cell.cell_id
        cdir.mkdir(parents=True, exist_ok=True)
        argv, _env = render(matrix, cell, 0, cdir / "run-K" / "data", f"{cell.cell_id}-rK")
        (cdir / "cell.json").write_bytes(orjson.dumps({"cell_id": cell.cell_id, "config": cell.config,
                                                       "command": shlex.join(argv), "runs": matrix.runs,
                                                       "kv_transfer_config": matrix.kv_config_json(cell)},
                                                      option=orjson.OPT_INDENT_2))
        for k in range(1, matrix.runs + 1):
            outcome = _run_once(matrix, out, cell, k)
            outcomes.append(outcome)
            if on_run is not None:
                on_run(outcome)
    return outcomes


def read_status(rdir: Path) -> dict[str, Any] | None:
    try:
        return orjson.loads((rdir / "status.json").read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None


def _run_once(matrix: Matrix, out: Path, cell: Cell, k: int) -> RunOutcome:
    rdir = run_dir(out, cell, k)
    status = read_status(rdir)
    fingerprint = run_fingerprint(matrix, cell, k)
    if status is not None and status.get("status") == "ok" and status.get("fingerprint") == fingerprint:
        return RunOutcome(cell.cell_id, k, "skipped")
    if rdir.exists():
        shutil.rmtree(rdir)  # a failed or interrupted run starts again from nothing
    rdir.mkdir(parents=True)
    run_id = f"{cell.cell_id}-r{k}"
    started = time.time()
    for _attempt in range(PORT_ATTEMPTS):  # the free port can be taken before the server binds it
        port = free_port()
        argv, extra_env = render(matrix, cell, port, rdir / "data", run_id)
        with open(rdir / "server.log", "wb") as log:
            outcome = _serve_and_load(matrix, cell, k, argv, extra_env, port, rdir, log)
        if not (outcome.status == "failed" and "before it was healthy" in outcome.reason
                and "address already in use" in outcome.log_tail.lower()):
            break
    record = {"status": outcome.status, "reason": outcome.reason, "log_tail": outcome.log_tail,
              "fingerprint": fingerprint,
              "command": shlex.join(argv), "env": extra_env, "port": port, "run_id": run_id,
              "started_unix_s": started, "seconds": time.time() - started}
    (rdir / "status.json").write_bytes(orjson.dumps(record, option=orjson.OPT_INDENT_2))
    return outcome


def _serve_and_load(matrix: Matrix, cell: Cell, k: int, argv: list[str], extra_env: dict[str, str], port: int,
                    rdir: Path, log: Any) -> RunOutcome:
    from otel_kvtrace.loadgen.client import LoadProfile, run_load

    env = {**os.environ, **extra_env}
    try:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    except OSError as exc:
        return RunOutcome(cell.cell_id, k, "failed", f"server did not start: {exc}")
    (rdir / "server.pid").write_text(f"{proc.pid}\n")
    try:
        base = f"http://127.0.0.1:{port}"
        reason = _wait_healthy(proc, base + matrix.health_path, matrix.startup_timeout_s)
        if reason:
            return _failed(cell, k, reason, rdir, proc)
        load = dict(matrix.load)
        profile = LoadProfile(base, str(load.get("endpoint", "/v1/completions")), None,
                              int(load.get("num_requests", 24)), matrix.concurrency(cell),
                              float(load.get("request_rate", float("inf"))), int(load.get("prompt_len", 1024)),
                              int(load.get("output_len", 8)), int(load.get("seed", 0)) + k,
                              float(load.get("timeout_s", 120)))
        result = run_load(profile)
        (rdir / "load.json").write_bytes(orjson.dumps(result.to_json(), option=orjson.OPT_INDENT_2))
        from otel_kvtrace.loadgen.spans import export_request_spans

        spans = export_request_spans(result, rdir / "data", f"load-{cell.cell_id}-r{k}")
        (rdir / "request_spans.json").write_bytes(orjson.dumps(spans, option=orjson.OPT_INDENT_2))
        if proc.poll() is not None:
            return _failed(cell, k, f"server exited with code {proc.returncode} during the load", rdir, proc)
        failed = result.summary()["failed"]
        if failed:
            return _failed(cell, k, f"{failed} requests failed: " + "; ".join(result.summary()["errors"]), rdir, proc)
        code = stop_server(proc)
        if code != 0:
            return _failed(cell, k, f"server exited with code {code} on SIGTERM", rdir, proc)
        return RunOutcome(cell.cell_id, k, "ok")
    finally:
        if proc.poll() is None:
            stop_server(proc)


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never via http_proxy


def _wait_healthy(proc: subprocess.Popen[bytes], url: str, timeout_s: float) -> str:
    """'' when ``url`` answers 200; else why not (process exited, timed out)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"server exited with code {proc.returncode} before it was healthy"
        try:
            with _DIRECT.open(url, timeout=2) as resp:
                if resp.status == 200:
                    return ""
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(0.1)
    return f"server not healthy at {url} after {timeout_s:g} s"


def stop_server(proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> int:
    """SIGTERM the server's process group, then SIGKILL after ``timeout_s``; its exit code."""
    if proc.poll() is None:
        _signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
    return int(proc.returncode)


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # start_new_session: the group is the server and its children only
    except ProcessLookupError:
        pass


def _failed(cell: Cell, k: int, reason: str, rdir: Path, proc: subprocess.Popen[bytes]) -> RunOutcome:
    stop_server(proc)
    return RunOutcome(cell.cell_id, k, "failed", reason, log_tail(rdir / "server.log"))


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_bytes().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])
