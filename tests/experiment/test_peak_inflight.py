"""Peak tasks in flight of a run comes from every task's own enqueue and completion (exact), not from the
sampled resource series, which can miss a short peak between two samples."""

from __future__ import annotations

import duckdb

from otel_kvtrace.experiment.analysis import _peak_inflight


def _con(rows: list[tuple[str, int, int | None]]) -> duckdb.DuckDBPyConnection:
    con = duckdb.connect()
    con.execute("CREATE TABLE tasks (queue VARCHAR, ts_enqueue BIGINT, ts_complete BIGINT)")
    if rows:
        con.executemany("INSERT INTO tasks VALUES (?, ?, ?)", rows)
    return con


def test_overlap_within_one_queue_is_counted_exactly() -> None:
    # q1: three tasks overlap during [6, 10); q2's one task never adds to q1's peak
    con = _con([("q1", 0, 10), ("q1", 5, 15), ("q1", 6, 12), ("q2", 7, 9)])
    assert _peak_inflight(con) == 3


def test_a_completion_at_an_enqueue_time_counts_first() -> None:
    con = _con([("q1", 0, 10), ("q1", 10, 20), ("q1", 20, 30)])
    assert _peak_inflight(con) == 1


def test_a_task_that_never_completed_stays_in_flight_to_the_end() -> None:
    # the third task has no completion: it is in flight until the run's last completion (15)
    con = _con([("q1", 0, 10), ("q1", 5, 15), ("q1", 12, None), ("q1", 14, 15)])
    assert _peak_inflight(con) == 3


def test_no_tasks_is_zero() -> None:
    assert _peak_inflight(_con([])) == 0
