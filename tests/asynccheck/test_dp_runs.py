"""A DP run (several engine-core processes of one run id) gets one verdict per engine process, never a
merge: our traces from the real vLLM DP loop, and an msServiceProfiler capture of two DP ranks."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner

from otel_kvtrace.asynccheck import model as m
from otel_kvtrace.asynccheck.analysis import check
from otel_kvtrace.asynccheck.runs import SeveralRunsError
from otel_kvtrace.cli import main

from . import msprof_writer as w
from . import vllm_engine as ve
from .test_vllm_conformance import GAP_TOLERANCE
from .vllm_src import VERSIONS, vllm_source

REPO = Path(__file__).resolve().parents[2]


def _true_gap_ms(truth: dict) -> float:
    return statistics.median(ve.true_gaps_ms(truth["device"], truth["wake_lags"]))


@pytest.mark.parametrize("version", VERSIONS)
def test_dp_engine_processes_of_real_vllm_get_one_verdict_each(tmp_path: Path, version: str) -> None:
    vllm_source(version)
    out = tmp_path / "async"
    env = dict(os.environ, OTEL_KVTRACE_ENABLED="1", OTEL_KVTRACE_RUN_ID="dp")
    proc = subprocess.run([sys.executable, "-m", "tests.asynccheck.dp_engines", version, str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    pids = [p.split(":") for p in proc.stdout.split()]
    assert [code for _, code in pids] == ["0", "0"], proc.stderr[-2000:]
    with pytest.raises(SeveralRunsError, match="2 engine processes"):
        check([out])
    json_path, html = tmp_path / "dp.json", tmp_path / "dp.html"
    result = CliRunner().invoke(main, ["async", "check", str(out), "--json", str(json_path), "--html", str(html)],
                                terminal_width=100)
    assert result.exit_code == 0, result.output
    assert "2 engine processes (DP ranks) in dp: one verdict per process" in result.output
    rows = {r["run"]: r for r in orjson.loads(json_path.read_bytes())}
    assert set(rows) == {f"dp pid{pid}" for pid, _ in pids}
    for pid, _ in pids:
        truth = json.loads((out / f"truth-{pid}.json").read_text())
        row = rows[f"dp pid{pid}"]
        assert row["metrics"]["comm_total_ms"] is not None  # its own DP all-reduces (sync_dp_state)
        gap, true_gap = row["metrics"]["gap_p50_ms"], _true_gap_ms(truth)
        if truth["rank"] == 0:
            assert row["verdict"] == "effective", row["reasons"]
            assert true_gap < 0.05 and gap < 0.1, (gap, true_gap)
        else:
            assert row["verdict"] == "not effective", row["reasons"]
            assert any("launch returns only after the device output is ready" in r for r in row["reasons"])
            assert abs(gap - true_gap) <= GAP_TOLERANCE * true_gap, (gap, true_gap)
        assert f"dp pid{pid}" in html.read_text()


def _dp_capture(tmp_path: Path) -> Path:
    """Two DP ranks of MindIE in one ``chrome_tracing.json`` (the parser's one file for every process):
    rank 0 async with MSPTI kernels (schedule pid 100, execution pid 200: effective); rank 1 synchronous,
    device-synchronised forwards (pids 300/400, another period and 3.3 ms later: not effective)."""
    spans, dev = w.mindie_async(12)
    events = w.chrome_events(spans, dev)
    at = lambda ms: w.T0_NS + int(round((ms + 3.3) * w.MS))  # noqa: E731
    sync: list[w.Span] = []
    for n in range(12):
        b = 12 * n
        sync.append(w.Span("BatchSchedule", "Schedule", at(b), at(b + 1), 300, 301, {"batch_size": 4}))
        sync.append(w.Span("Execute", "Schedule", at(b + 1), at(b + 1.2), 300, 301))
        sync.append(w.Span("forward", "ModelExecute", at(b + 1.2), at(b + 9), 400, 401))
    events += [e for e in w.chrome_events(sync, []) if e.get("ph") == "X"]
    folder = tmp_path / "dp_capture"
    folder.mkdir()
    (folder / "chrome_tracing.json").write_text(json.dumps(events))
    return folder


def test_dp_capture_gets_one_verdict_per_engine_process(tmp_path: Path) -> None:
    folder = _dp_capture(tmp_path)
    with pytest.raises(SeveralRunsError, match="2 engine processes"):
        check([folder])
    json_path = tmp_path / "c.json"
    result = CliRunner().invoke(main, ["async", "check", str(folder), "--json", str(json_path)], terminal_width=100)
    assert result.exit_code == 0, result.output
    rows = {r["run"]: r for r in orjson.loads(json_path.read_bytes())}
    assert set(rows) == {f"capture {folder} pid100", f"capture {folder} pid300"}
    assert rows[f"capture {folder} pid100"]["verdict"] == "effective", rows[f"capture {folder} pid100"]["reasons"]
    assert rows[f"capture {folder} pid300"]["verdict"] == "not effective"
    for row in rows.values():
        kinds = [x["kind"] for x in row["warnings"]]
        assert m.WARN_MULTI_PROCESS not in kinds  # each verdict reads its own engine's processes only
        assert kinds.count(m.WARN_PROCESS_JOINED) == 1


def test_worker_processes_follow_their_parent_engine_process() -> None:
    """DP with MultiprocExecutor: each rank's workers run concurrently with the other rank's, so time
    cannot tell them apart; the worker's resource ``process.parent_pid`` does."""
    from otel_kvtrace.asynccheck.runs import split_processes

    def span(lane: str, name: str, step: int | None = None, **attrs: object) -> m.SpanRow:
        return m.SpanRow("r", "f", lane, step, name, name, 0, 1, dict(attrs))

    spans = [span("r/pid10", m.BATCH_SCHEDULE, 0), span("r/pid20", m.BATCH_SCHEDULE, 0),
             span("r/pid11", m.OUTPUT_READY, ppid=10), span("r/pid21", m.WORKER_LAUNCH, ppid=20),
             span("r/pid31", m.OUTPUT_READY)]  # an older trace without process.parent_pid
    procs, notes = split_processes(spans)
    lanes = {key: sorted(s.lane for s in ss) for key, ss in procs.items()}
    assert lanes == {"r pid10": ["r/pid10", "r/pid11"], "r pid20": ["r/pid20", "r/pid21"]}  # never both ranks
    assert {key: [(kind, text.split(":")[0]) for kind, text in ns] for key, ns in notes.items()} == {
        "r pid10": [(m.WARN_PROCESS_LEFT_OUT, "pid 31")], "r pid20": [(m.WARN_PROCESS_LEFT_OUT, "pid 31")]}
