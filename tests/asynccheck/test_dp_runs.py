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
from .test_vllm_conformance import assert_gap, measured_step_gaps
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
    assert set(rows) == {"dp DP0", "dp DP1"}  # labelled by the engines' DP rank, not their pids
    for pid, _ in pids:
        truth = json.loads((out / f"truth-{pid}.json").read_text())
        row = rows[f"dp DP{truth['rank']}"]
        assert row["metrics"]["comm_total_ms"] is not None  # its own DP all-reduces (sync_dp_state)
        gap, true_gap = row["metrics"]["gap_p50_ms"], _true_gap_ms(truth)
        if truth["rank"] == 0:
            assert row["verdict"] == "effective", row["reasons"]
            assert true_gap < 0.05 and gap < 0.1, (gap, true_gap)
        else:
            assert row["verdict"] == "not effective", row["reasons"]
            assert any("launch returns only after the device output is ready" in r for r in row["reasons"])
            true_gaps = ve.true_gaps_ms(truth["device"], truth["wake_lags"])
            assert_gap(check([out], run=row["run"]), true_gaps, measured_step_gaps([out], row["run"]))
        assert f"dp DP{truth['rank']}" in html.read_text()


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


def test_engine_processes_are_labelled_by_dp_rank_where_every_one_names_it() -> None:
    """vLLM's DP rank (``vllm.dp_rank`` on the trace resource) labels each verdict; the workers follow their
    parent engine. Where one engine names no rank (an older trace) or two name the same, pids stay."""
    from otel_kvtrace.asynccheck.runs import split_processes

    def span(lane: str, name: str, step: int | None = None, **attrs: object) -> m.SpanRow:
        return m.SpanRow("r", "f", lane, step, name, name, 0, 1, dict(attrs))

    workers = [span("r/pid11", m.OUTPUT_READY, ppid=10), span("r/pid21", m.WORKER_LAUNCH, ppid=20)]
    procs, _ = split_processes([span("r/pid10", m.BATCH_SCHEDULE, 0, dp_rank=1),
                                span("r/pid20", m.BATCH_SCHEDULE, 0, dp_rank=0), *workers])
    assert {key: sorted(s.lane for s in ss) for key, ss in procs.items()} == {
        "r DP1": ["r/pid10", "r/pid11"], "r DP0": ["r/pid20", "r/pid21"]}
    for ranks in ((1, None), (0, 0)):
        engines = [span(f"r/pid{pid}", m.BATCH_SCHEDULE, 0, **({} if rank is None else {"dp_rank": rank}))
                   for pid, rank in zip((10, 20), ranks)]
        assert set(split_processes([*engines, *workers])[0]) == {"r pid10", "r pid20"}, ranks


def test_the_dp_rank_comes_from_vllms_parallel_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """``data_parallel_index`` (set per engine process by vLLM's ``run_engine_core``, 0.23 and 0.33), then
    ``DPEngineCoreProc.dp_rank``, then ``VLLM_DP_RANK``; none of them: no rank (pid labels)."""
    from types import SimpleNamespace

    from otel_kvtrace.asynccheck.instrument import dp_rank

    monkeypatch.delenv("VLLM_DP_RANK", raising=False)
    config = lambda **kw: SimpleNamespace(vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(**kw)))  # noqa: E731
    assert dp_rank(config(data_parallel_index=3, data_parallel_rank=0)) == 3  # dense model: rank reset to 0
    assert dp_rank(SimpleNamespace(dp_rank=2)) == 2
    assert dp_rank(SimpleNamespace()) is None
    monkeypatch.setenv("VLLM_DP_RANK", "5")
    assert dp_rank(SimpleNamespace()) == 5
