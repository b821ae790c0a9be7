"""Demo traces re-sent with the project's own exporter to `kvtrace collect` over gRPC and HTTP from two
processes at once: the collected files must load into exactly the same tasks as the directly written ones,
and `kvtrace report` must find the same tasks and the same HOL blocking in them."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from otel_kvtrace.demo import run_demo
from otel_kvtrace.load import load_traces
from tests.collect.helpers import CollectProcess

RESEND = Path(__file__).with_name("resend.py")


@pytest.fixture(scope="module")
def direct_and_collected(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Path], Path]:
    root = tmp_path_factory.mktemp("e2e")
    demo = run_demo("both", steps=30, out=root / "direct")
    files = [f for sc in demo.scenarios for f in sc.trace_files]
    assert len(files) == 2
    out = root / "collected"
    collector = CollectProcess(out)
    try:
        senders = [
            subprocess.Popen(
                [sys.executable, str(RESEND), protocol, f"http://127.0.0.1:{port}", str(shard), "2", *map(str, files)],
                stderr=subprocess.PIPE,
            )
            for shard, (protocol, port) in enumerate(
                (("grpc", collector.grpc_port), ("http/protobuf", collector.http_port))
            )
        ]
        for p in senders:
            _, err = p.communicate(timeout=120)
            assert p.returncode == 0, err.decode()
    finally:
        code, log = collector.terminate(signal.SIGTERM)
    assert code == 0, log
    assert "malformed 0 grpc + 0 http" in log and "refused 0 (queue full)" in log
    accepted = re.search(r"accepted (\d+) grpc \+ (\d+) http requests", log)
    assert accepted and int(accepted.group(1)) > 0 and int(accepted.group(2)) > 0, log  # both protocols used
    return files, out


def _rows(paths: list[Path] | Path, table: str) -> tuple[list[str], list[tuple[object, ...]]]:
    con = load_traces(paths).con
    columns = [c for (c, *_) in con.sql(f"DESCRIBE {table}").fetchall() if "file" not in c]
    key = "correlation_id, span_id" if table == "tasks" else "trace_id, span_id"
    rows = con.sql(f"SELECT {', '.join(columns)} FROM {table} ORDER BY {key}").fetchall()
    return columns, rows


def test_collected_files_load_into_the_same_tasks_and_spans(direct_and_collected: tuple[list[Path], Path]) -> None:
    files, collected = direct_and_collected
    assert sorted(p.name for p in collected.glob("*.jsonl")) and all(
        p.name.startswith("collected-") for p in collected.glob("*.jsonl")
    )
    for table in ("tasks", "spans"):
        direct_cols, direct_rows = _rows(files, table)
        collected_cols, collected_rows = _rows(collected, table)
        assert direct_cols == collected_cols
        assert len(direct_rows) == len(collected_rows) > 0
        assert direct_rows == collected_rows, f"{table} differ after the round trip through kvtrace collect"


def _report_json(tmp_path: Path, name: str, *inputs: Path) -> dict[str, Any]:
    out = tmp_path / f"{name}.json"
    proc = subprocess.run(
        [sys.executable, "-m", "otel_kvtrace.cli", "report", *map(str, inputs), "--json", str(out), "--no-cache"],
        capture_output=True, text=True, check=False, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    return json.loads(out.read_text())


def _same(a: Any, b: Any, where: str = "") -> None:
    """Equal structures; floats equal to 1e-9 relative (sums may run in another row order)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            _same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, float):
        assert b == pytest.approx(a, rel=1e-9, abs=1e-12), where
    else:
        assert a == b, where


def test_kvtrace_report_on_collected_files_gives_the_same_tasks_and_hol(
    direct_and_collected: tuple[list[Path], Path], tmp_path: Path
) -> None:
    files, collected = direct_and_collected
    direct = _report_json(tmp_path, "direct", *files)
    via_collect = _report_json(tmp_path, "collected", collected)
    assert direct["tasks"]["count"] > 0 and direct["hol"]["events"] > 0  # the hol scenario has HOL events
    assert via_collect["tasks"]["count"] == direct["tasks"]["count"]
    assert via_collect["hol"]["events"] == direct["hol"]["events"]
    for section in direct.keys() - {"load"}:  # load lists file names and timings
        _same(direct[section], via_collect[section], section)
    assert via_collect["load"]["spans"] == direct["load"]["spans"] and via_collect["load"]["malformed_count"] == 0
