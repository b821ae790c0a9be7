"""Analyses of loaded traces: one function per question, each returning rows of one ``queries/*.sql``.

Every function takes a DuckDB connection holding the loader's ``spans``/``tasks`` (see
``otel_kvtrace.load.load_traces``) and returns a ``QueryResult`` (``columns``, ``rows``, ``records()``);
the SQL file's header documents the columns. Nothing here renders: ``otel_kvtrace.report`` does.

Example::

    from otel_kvtrace.load import load_traces
    from otel_kvtrace import analyse
    con = load_traces("kvtrace-data/traces").con
    analyse.hol_summary(con).records()
"""

from __future__ import annotations

import duckdb

from otel_kvtrace.analyse.queries import (
    QueryResult,
    all_queries,
    drop_materialized,
    ensure_view,
    install_views,
    materialize,
    run_query,
)


def stage_breakdown(con: duckdb.DuckDBPyConnection) -> QueryResult:
    """Count and p50/p95/p99/max per stage, per configuration and path."""
    return run_query(con, "stage_breakdown")


def hol_intervals(con: duckdb.DuckDBPyConnection) -> QueryResult:
    """Every HOL interval (docs/analysis.md, "HOL definition") with its head, evidence task and class."""
    return run_query(con, "hol_intervals")


def hol_summary(con: duckdb.DuckDBPyConnection) -> QueryResult:
    """HOL events, total and percentile durations, share of dependency wait; per configuration and path."""
    return run_query(con, "hol_summary")


def queue_depth(con: duckdb.DuckDBPyConnection) -> QueryResult:
    """Queued and in-flight task counts after every enqueue/dequeue/completion, per queue."""
    return run_query(con, "queue_depth")


def consumer_stall(con: duckdb.DuckDBPyConnection) -> QueryResult:
    """The forward thread's wait for every layer, per step."""
    return run_query(con, "consumer_stall")


def wait_explained(con: duckdb.DuckDBPyConnection) -> QueryResult:
    """Tasks whose stage spans do not explain their total time within 1%."""
    return run_query(con, "wait_explained")


__all__ = [
    "QueryResult",
    "all_queries",
    "consumer_stall",
    "drop_materialized",
    "ensure_view",
    "hol_intervals",
    "hol_summary",
    "install_views",
    "materialize",
    "queue_depth",
    "run_query",
    "stage_breakdown",
    "wait_explained",
]
