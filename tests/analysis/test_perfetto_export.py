"""``kvtrace export --perfetto``: the demo-like synthetic traces as Trace Event JSON, checked against the
format (tests/analysis/trace_event_format.py) and against the analysis it shows."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import orjson
from click.testing import CliRunner


from otel_kvtrace.analyse import run_query
from otel_kvtrace.cli import main
from otel_kvtrace.load import load_traces
from otel_kvtrace.report.perfetto import FLOW_CATEGORY, perfetto_trace

from .trace_event_format import check_trace


def test_export_is_valid_trace_event_json_with_one_flow_per_hol_event(synthetic_trace_dir: Path,
                                                                       tmp_path: Path) -> None:
    out = tmp_path / "kv.perfetto.json"
    result = CliRunner().invoke(main, ["export", "--perfetto", str(out), str(synthetic_trace_dir)])
    assert result.exit_code == 0, result.output
    doc = orjson.loads(out.read_bytes())
    assert check_trace(doc) == []

    con = load_traces([synthetic_trace_dir]).con
    events = run_query(con, "hol_events").records()
    tasks = con.execute("SELECT count(*), count(DISTINCT run_id), count(DISTINCT queue) FROM tasks").fetchone()
    trace = doc["traceEvents"]
    flows = [e for e in trace if e["ph"] in ("s", "f") and e["cat"] == FLOW_CATEGORY]
    assert Counter(e["ph"] for e in flows) == {"s": len(events), "f": len(events)} and events
    processes = [e for e in trace if e["ph"] == "M" and e["name"] == "process_name"]
    assert len(processes) == tasks[1]  # one process per run
    threads = {e["args"]["name"] for e in trace if e["ph"] == "M" and e["name"] == "thread_name"}
    assert sum(name.startswith("recv ") and "overlap" not in name for name in threads) == tasks[2]
    assert any(name.startswith("forward ") for name in threads) and any(name.startswith("send ") for name in threads)
    task_slices = [e for e in trace if e["ph"] == "X" and e["name"] == "task"]
    assert len(task_slices) == tasks[0]
    # the flow starts on the head's own task slice and ends on its HOL slice, which names the evidence
    by_id = {e["args"]["correlation_id"]: e for e in task_slices}
    hol = {(e["pid"], e["tid"], e["args"]["head"]): e for e in trace if e["ph"] == "X" and e["cat"] == FLOW_CATEGORY}
    expected = {e["head_correlation_id"]: e for e in events}
    for start, end in zip(sorted((e for e in flows if e["ph"] == "s"), key=lambda e: e["id"]),
                          sorted((e for e in flows if e["ph"] == "f"), key=lambda e: e["id"])):
        head_slices = [t for t in task_slices if (t["pid"], t["tid"]) == (start["pid"], start["tid"])
                       and t["ts"] <= start["ts"] <= t["ts"] + t["dur"]]
        (head_slice,) = head_slices
        head = head_slice["args"]["correlation_id"]
        target = hol[(end["pid"], end["tid"], head)]
        assert target["args"]["evidence"] == expected[head]["evidence_correlation_id"]
        assert target["dur"] * 1e3 >= expected[head]["dur_ns"] - 1  # slice spans the event's intervals
        assert by_id[head]["ts"] <= target["ts"]
    depth = run_query(con, "queue_depth").records()
    counters = [e for e in trace if e["ph"] == "C"]
    assert len(counters) == len(depth)
    for queue in {d["queue"] for d in depth}:
        series = [e for e in counters if queue.endswith(e["name"].removeprefix("queue "))]
        assert max(e["args"]["queued"] for e in series) == max(d["depth"] for d in depth if d["queue"] == queue)
        assert max(e["args"]["in_flight"] for e in series) == max(d["inflight"] for d in depth if d["queue"] == queue)


def test_stage_slices_nest_in_their_task_and_keep_nanoseconds(synthetic_trace_dir: Path) -> None:
    con = load_traces([synthetic_trace_dir]).con
    doc = perfetto_trace(con)
    t0 = doc["otherData"]["t0_unix_ns"]
    row = con.execute("""SELECT correlation_id, meta_build_start, meta_build_ns FROM tasks
                         WHERE meta_build_ns IS NOT NULL ORDER BY seq LIMIT 1""").fetchone()
    (stage,) = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["name"] == "meta_build"
                and e["args"]["correlation_id"] == row[0]]
    assert round(stage["ts"] * 1e3) == row[1] - t0 and round(stage["dur"] * 1e3) == row[2]


def test_checker_catches_broken_documents() -> None:
    """The format checker must fail on each defect it claims to find."""
    ok = {"ph": "X", "name": "a", "pid": 1, "tid": 1, "ts": 0, "dur": 10}
    assert check_trace({"traceEvents": [ok]}) == []
    assert check_trace({"traceEvents": [{**ok, "dur": None}]})
    assert check_trace({"traceEvents": [ok, {**ok, "ts": 5, "dur": 10}]})  # overlap without nesting
    assert check_trace({"traceEvents": [{"ph": "C", "name": "c", "pid": 1, "tid": 0, "ts": 0, "args": {"x": "a"}}]})
    flow = {"cat": "c", "name": "f", "id": 1, "pid": 1, "tid": 1, "bp": "e"}
    assert check_trace({"traceEvents": [ok, {**flow, "ph": "s", "ts": 1}]})  # no end
    assert check_trace({"traceEvents": [ok, {**flow, "ph": "s", "ts": 1}, {**flow, "ph": "f", "ts": 50}]})
    assert check_trace({"traceEvents": [ok, {**flow, "ph": "s", "ts": 1}, {**flow, "ph": "f", "ts": 2}]}) == []
