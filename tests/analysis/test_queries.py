"""queries/*.sql: documented headers that match the real output columns, runnable as plain SQL over a
database the loader wrote, and results checked against Python computed from the synthetic tasks."""

from __future__ import annotations

import statistics
from pathlib import Path

import duckdb
import pytest
from synthetic_traces import QueueSpec, simulate_queue, write_otlp_json

from otel_kvtrace.analyse import all_queries, install_views, run_query
from otel_kvtrace.load import load_traces

SPEC = QueueSpec(run_id="q", cfg_label="cfg q")


@pytest.fixture(scope="module")
def tasks_and_con(tmp_path_factory: pytest.TempPathFactory):
    tasks = simulate_queue(SPEC, 120, seed=9, hol_probability=0.2)
    # One task with a 30% unexplained gap between its stages, one whose stages overlap.
    gap = tasks[10]
    start, end = gap.stages["backend_submit"]
    gap.stages["backend_submit"] = (start, start + (end - start) // 10)
    path = write_otlp_json(tmp_path_factory.mktemp("q") / "q.jsonl", [(SPEC, tasks)])
    return tasks, load_traces(path).con


@pytest.mark.parametrize("name", sorted(all_queries()))
def test_every_query_documents_exactly_its_columns(name: str, tasks_and_con) -> None:
    doc = all_queries()[name]
    header = doc.sql.split("WITH")[0] if doc.sql.lstrip().startswith("--") else ""
    for key in ("-- name:", "-- implements:", "-- requires:", "-- purpose:", "-- definition:", "-- columns:"):
        assert key in header, f"{name}.sql header lacks {key}"
    assert doc.name == name and doc.purpose
    result = run_query(tasks_and_con[1], name)
    assert result.columns == [c.name for c in doc.columns], f"{name}.sql: documented columns differ"
    assert all(c.description for c in doc.columns)


def test_queries_run_from_a_database_file_as_plain_sql(tmp_path: Path, tasks_and_con) -> None:
    """What a DuckDB CLI user does: open the loader's database and run a .sql file's text."""
    db = tmp_path / "kv.duckdb"
    con = duckdb.connect(str(db))
    load_traces(write_otlp_json(tmp_path / "t.jsonl", [(SPEC, tasks_and_con[0])]), con=con)
    install_views(con)
    con.close()
    con = duckdb.connect(str(db), read_only=True)
    for name, doc in all_queries().items():
        rows = con.execute(doc.sql).fetchall()
        assert rows == con.execute(f"SELECT * FROM {name}").fetchall()


def test_stage_breakdown_matches_python(tasks_and_con) -> None:
    tasks, con = tasks_and_con
    rows = {r["stage"]: r for r in run_query(con, "stage_breakdown").records()}
    for stage in ("queue_wait", "backend_submit", "save_cpu_wait"):
        durations = [t.stages[stage][1] - t.stages[stage][0] for t in tasks if stage in t.stages]
        assert rows[stage]["count"] == len(durations)
        assert rows[stage]["max_ms"] == max(durations) / 1e6
        assert rows[stage]["p50_ms"] == pytest.approx(statistics.median(durations) / 1e6)
    assert rows["task_total"]["count"] == len(tasks)


def test_queue_depth_matches_python(tasks_and_con) -> None:
    tasks, con = tasks_and_con
    events = sorted([(t.enqueue, 0, t.seq, 1, 1) for t in tasks] + [(t.dequeue, 1, t.seq, -1, 0) for t in tasks]
                    + [(t.complete, 2, t.seq, 0, -1) for t in tasks])
    expected, depth, inflight = [], 0, 0
    for ts, _tie, seq, d_depth, d_inflight in events:
        depth += d_depth
        inflight += d_inflight
        expected.append((ts, seq, depth, inflight))
    rows = run_query(con, "queue_depth").records()
    assert [(r["ts_ns"], r["seq"], r["depth"], r["inflight"]) for r in rows] == expected
    assert max(r["depth"] for r in rows) > 1  # the workload does queue up


def test_wait_explained_lists_the_gap_and_nothing_else(tasks_and_con) -> None:
    tasks, con = tasks_and_con
    rows = run_query(con, "wait_explained").records()
    cid = SPEC.correlation_id(tasks[10].step, tasks[10].layer_id)
    listed = {r["correlation_id"]: r for r in rows}
    assert cid in listed and listed[cid]["reason"] == "gap" and listed[cid]["unexplained_pct"] > 1
    for task in tasks:
        if task.seq == 10:
            continue
        total = task.complete - task.enqueue
        explained = sum(e - s for n, (s, e) in task.stages.items() if n != "consumer_wait")
        flagged = abs(total - explained) > 0.01 * total
        assert (SPEC.correlation_id(task.step, task.layer_id) in listed) == flagged


def test_consumer_stall_sums_per_step(tasks_and_con) -> None:
    tasks, con = tasks_and_con
    rows = run_query(con, "consumer_stall").records()
    assert len(rows) == len(tasks)
    step0 = sum(t.stages["consumer_wait"][1] - t.stages["consumer_wait"][0] for t in tasks if t.step == 0)
    assert {r["step_wait_ms"] for r in rows if r["step"] == 0} == {step0 / 1e6}
