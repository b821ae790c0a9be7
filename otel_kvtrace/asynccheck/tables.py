"""DuckDB tables of the async check (columns documented in docs/async_check.md).

``load_run`` imports every capture file of one run and appends to ``async_spans``, ``async_steps``,
``async_markers``, ``async_warnings`` and ``async_import_errors``; several runs (``--compare``) share
one connection, told apart by the ``run`` column.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import fields
from pathlib import Path
from typing import Any

import duckdb
import orjson
import pyarrow as pa

from otel_kvtrace.asynccheck import model as m
from otel_kvtrace.asynccheck.importers import capture_files, import_paths
from otel_kvtrace.asynccheck.runs import refuse_empty, refuse_mixed, select_process
from otel_kvtrace.asynccheck.steps import build_steps, dedup_markers, dedup_sources, run_warnings

SCHEMA = """
CREATE TABLE IF NOT EXISTS async_spans(
    run VARCHAR, file VARCHAR, lane VARCHAR, step BIGINT, name VARCHAR, origin VARCHAR,
    start_ns BIGINT, end_ns BIGINT, dur_ns BIGINT, attrs JSON);
CREATE TABLE IF NOT EXISTS async_steps(
    run VARCHAR, lane VARCHAR, step BIGINT,
    schedule_start BIGINT, schedule_end BIGINT, launch_start BIGINT, launch_end BIGINT,
    device_start BIGINT, done BIGINT, update_start BIGINT, update_end BIGINT,
    done_precision VARCHAR, batch_queue BOOLEAN, queue_depth INTEGER, batch_size INTEGER, batch_type VARCHAR,
    worker_launch_start BIGINT, worker_launch_end BIGINT);
CREATE TABLE IF NOT EXISTS async_markers(run VARCHAR, file VARCHAR, marker VARCHAR, count BIGINT);
CREATE TABLE IF NOT EXISTS async_warnings(run VARCHAR, file VARCHAR, kind VARCHAR, message VARCHAR);
CREATE TABLE IF NOT EXISTS async_requests(
    run VARCHAR, file VARCHAR, rid VARCHAR, start_ns BIGINT, latency_ms DOUBLE, ttft_ms DOUBLE, queue_ms DOUBLE,
    out_tokens BIGINT);
CREATE TABLE IF NOT EXISTS async_import_errors(run VARCHAR, file VARCHAR, line BIGINT, reason VARCHAR);
"""

_STEP_TYPES: dict[str, pa.DataType] = {
    "run": pa.string(), "lane": pa.string(), "step": pa.int64(), "done_precision": pa.string(),
    "batch_queue": pa.bool_(), "queue_depth": pa.int32(), "batch_size": pa.int32(), "batch_type": pa.string(),
}


def connect(database: str = ":memory:") -> duckdb.DuckDBPyConnection:
    """A DuckDB connection with the async-check tables created."""
    con = duckdb.connect(database)
    con.execute(SCHEMA)
    return con


def _insert(con: duckdb.DuckDBPyConnection, table: str, columns: dict[str, list[Any]], types: dict[str, pa.DataType]) -> None:
    if not next(iter(columns.values())):
        return
    arrow = pa.table({k: pa.array(v, type=types.get(k, pa.int64())) for k, v in columns.items()})
    con.register("_async_rows", arrow)
    try:
        con.execute(f"INSERT INTO {table} BY NAME SELECT * FROM _async_rows")
    finally:
        con.unregister("_async_rows")


def _records(con: duckdb.DuckDBPyConnection, table: str, rows: Iterable[Any], types: dict[str, pa.DataType]) -> None:
    rows = list(rows)
    if not rows:
        return
    names = [f.name for f in fields(rows[0])]
    _insert(con, table, {n: [getattr(r, n) for r in rows] for n in names}, types)


def load_run(con: duckdb.DuckDBPyConnection, paths: Iterable[str | Path], run: str) -> m.ImportResult:
    """Import ``paths`` as run ``run`` into ``con``; returns what was imported (for reporting).

    Raises ``runs.NothingToCheckError`` for an input without async spans it can name (empty, KV traces)
    and ``runs.SeveralRunsError`` when ``paths`` hold several runs (never one merged verdict).
    """
    paths = list(paths)
    result = import_paths(paths, run)
    refuse_empty(paths, capture_files(paths), result)
    refuse_mixed(result)
    select_process(result, run)
    result.spans = dedup_sources(result.spans)
    result.markers = dedup_markers(result.markers)
    lost = [x.split(":", 1)[1] for x in result.seen if x.startswith("start_lost:")]
    steps, step_warnings = build_steps(result.spans, run, lost)
    result.warnings += step_warnings + run_warnings(result.spans, result.seen, run)
    s = result.spans
    _insert(
        con,
        "async_spans",
        {
            "run": [x.run for x in s], "file": [x.file for x in s], "lane": [x.lane for x in s],
            "step": [x.step for x in s], "name": [x.name for x in s], "origin": [x.origin for x in s],
            "start_ns": [x.start_ns for x in s], "end_ns": [x.end_ns for x in s],
            "dur_ns": [x.end_ns - x.start_ns for x in s],
            "attrs": [orjson.dumps(x.attrs, default=str).decode() for x in s],
        },
        {k: pa.string() for k in ("run", "file", "lane", "name", "origin", "attrs")},
    )
    _records(con, "async_steps", steps, _STEP_TYPES)
    text = {k: pa.string() for k in ("run", "file", "marker", "kind", "message", "reason")}
    _records(con, "async_markers", result.markers, text)
    _records(con, "async_warnings", result.warnings, text)
    _records(con, "async_import_errors", result.issues, text)
    _records(con, "async_requests", result.requests,
             {**text, "rid": pa.string(), "latency_ms": pa.float64(), "ttft_ms": pa.float64(),
              "queue_ms": pa.float64()})
    return result
