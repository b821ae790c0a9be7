"""Peak tasks in flight of a run comes from every task's own enqueue and completion (exact,
``queries/queue_depth_summary.sql``), not from the sampled resource series, which can miss a short peak
between two samples."""

from __future__ import annotations

import duckdb

from otel_kvtrace.experiment.analysis import _peak_inflight


def _con(rows: list[tuple[str, int, int | None]]) -> duckdb.DuckDBPyConnection:
    con = duckdb.connect()
    con.execute("CREATE TABLE tasks (queue VARCHAR, cfg_label VARCHAR, path VARCHAR, run_id VARCHAR, "
                "correlation_id VARCHAR, seq BIGINT, ts_enqueue BIGINT, ts_dequeue BIGINT, ts_complete BIGINT)")
    for seq, (queue, enq, done) in enumerate(rows):
        con.execute("INSERT INTO tasks VALUES (?, 'c', 'gva', 'r', ?, ?, ?, ?, ?)",
                    [queue, f"t{seq}", seq, enq, enq, done])
    return con


def test_overlap_within_one_queue_is_counted_exactly() -> None:
    # q1: three tasks overlap during [6, 10); q2's one task never adds to q1's peak
    con = _con([("q1", 0, 10), ("q1", 5, 15), ("q1", 6, 12), ("q2", 7, 9)])
    assert _peak_inflight(con) == 3


def test_tasks_that_never_completed_stay_in_flight() -> None:
    # enqueued after the run's last completion (a run cut short), and a run with no completion at all
    assert _peak_inflight(_con([("q1", 0, 10), ("q1", 12, None), ("q1", 13, None)])) == 2
    assert _peak_inflight(_con([("q1", 0, None), ("q1", 1, None)])) == 2


def test_no_tasks_is_zero() -> None:
    assert _peak_inflight(_con([])) == 0
