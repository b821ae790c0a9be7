"""``build_report``: run every analysis once and keep the results the renderers need.

The renderers (terminal, JSON, PNG, HTML) only format a ``Report``; they never query DuckDB, so all four
outputs show the same numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb

from otel_kvtrace import analyse
from otel_kvtrace.analyse.queries import QueryResult, ensure_view, materialize
from otel_kvtrace.load import LoadResult, LoadStats, load_traces
from otel_kvtrace.load.tasks_sql import DEPS, STAGES
from otel_kvtrace.npu_profile import NpuProfile

DEFAULT_TIMELINE_TASKS = 1500
"""Tasks drawn in the HTML/PNG timelines (a window around the longest HOL event of each queue)."""

MAX_TIMELINE_QUEUES = 8
STAGE_SAMPLE = 20_000


@dataclass(slots=True)
class Report:
    """Everything a report shows, computed once."""

    stats: LoadStats
    configs: QueryResult  # cfg_label, path, queues, tasks
    stages: QueryResult
    hol_summary: QueryResult
    hol_intervals: QueryResult
    hol_overall: dict[str, Any]
    queue_depth: QueryResult  # per queue: max/mean depth and inflight
    consumer_stall: QueryResult  # per config: per-step consumer wait summary
    wait_explained: QueryResult
    wait_explained_total: int
    timeline: dict[str, Any] = field(default_factory=dict)
    stage_samples: dict[str, list[int]] = field(default_factory=dict)  # stage -> sampled durations, ns
    pngs: dict[str, bytes] = field(default_factory=dict)  # rendered plots, filled by report.plots


def _query(con: duckdb.DuckDBPyConnection, sql: str) -> QueryResult:
    cursor = con.execute(sql)
    columns = [d[0] for d in cursor.description]
    return QueryResult(columns, cursor.fetchall())


def build_report(
    paths: Iterable[str | Path] | str | Path | LoadResult,
    *,
    cache_dir: str | Path | None = None,
    con: duckdb.DuckDBPyConnection | None = None,
    timeline_tasks: int = DEFAULT_TIMELINE_TASKS,
    progress: Callable[[str], None] | None = None,
    npu: NpuProfile | None = None,
) -> Report:
    """Load ``paths`` (or reuse a ``LoadResult``) and run every analysis of ``otel_kvtrace.analyse``.

    Example::

        report = build_report(["kvtrace-data/traces"])
        report.hol_overall["events"]
    """
    loaded = paths if isinstance(paths, LoadResult) else load_traces(
        paths, cache_dir=cache_dir, con=con, progress=progress)
    con = loaded.con
    if progress:
        progress("running queries ...")
    materialize(con, "hol_intervals")  # read by the summary, the overall figures, the timeline and JSON
    try:
        configs = _query(con, """
            SELECT cfg_label, path, count(DISTINCT queue) AS queues, count(*) AS tasks
            FROM tasks GROUP BY ALL ORDER BY cfg_label, path""")
        summary = analyse.hol_summary(con)
        hol_overall = _hol_overall(con, summary)
        ensure_view(con, "queue_depth")
        depth = _query(con, """
            SELECT queue, any_value(cfg_label) AS cfg_label, any_value(path) AS path,
                   max(depth) AS max_depth, avg(depth) FILTER (WHERE event = 'enqueue') AS mean_depth_at_enqueue,
                   max(inflight) AS max_inflight
            FROM queue_depth GROUP BY queue ORDER BY queue""")
        ensure_view(con, "consumer_stall")
        stall = _query(con, """
            WITH steps AS (
                SELECT cfg_label, path, queue, step, sum(wait_ms) AS wait_ms, sum(stall_after_ready_ms) AS after_ready_ms
                FROM consumer_stall GROUP BY ALL)
            SELECT cfg_label, path, count(*) AS steps, sum(wait_ms) AS total_wait_ms,
                   sum(after_ready_ms) AS after_ready_ms,
                   quantile_cont(wait_ms, 0.5) AS step_p50_ms, quantile_cont(wait_ms, 0.95) AS step_p95_ms,
                   quantile_cont(wait_ms, 0.99) AS step_p99_ms, max(wait_ms) AS step_max_ms
            FROM steps GROUP BY ALL ORDER BY cfg_label, path""")
        ensure_view(con, "wait_explained")
        explained_total = con.execute("SELECT count(*) FROM wait_explained").fetchall()[0][0]
        explained = _query(con, "SELECT * FROM wait_explained LIMIT 200")
        report = Report(
            stats=loaded.stats,
            configs=configs,
            stages=analyse.stage_breakdown(con),
            hol_summary=summary,
            hol_intervals=_query(con, "SELECT * FROM hol_intervals ORDER BY queue, head_seq, start_ns"),
            hol_overall=hol_overall,
            queue_depth=depth,
            consumer_stall=stall,
            wait_explained=explained,
            wait_explained_total=explained_total,
        )
        report.timeline = timeline_data(con, timeline_tasks)
        report.timeline["npu"] = npu_timeline(npu, report.timeline) if npu else {"lanes": [], "events": []}
        report.stage_samples = stage_samples(con)
    finally:  # a later load into this connection must not meet stale intervals
        con.execute("DROP TABLE IF EXISTS temp.hol_intervals").fetchall()
    return report


def npu_timeline(npu: NpuProfile, timeline: dict[str, Any]) -> dict[str, Any]:
    """The NPU profiler's slices that overlap the tasks shown, on the timeline's µs axis, one lane per
    kind and stream/plane."""
    t0 = timeline["t0_ns"]
    times = [s[2] for t in timeline["tasks"] for s in t["stages"]] + [t["enqueue"] for t in timeline["tasks"]]
    if not times:
        return {"lanes": [], "events": []}
    lo, hi = t0 + min(times) * 1e3, t0 + max(times) * 1e3
    lanes: list[str] = []
    events = []
    for e in npu.events:
        if e.end_ns < lo or e.start_ns > hi:
            continue
        lane = f"{e.kind} {e.lane}"
        if lane not in lanes:
            lanes.append(lane)
        events.append({"lane": lanes.index(lane), "kind": e.kind, "name": e.name,
                       "start": round((e.start_ns - t0) / 1e3, 3), "end": round((e.end_ns - t0) / 1e3, 3)})
    return {"lanes": lanes, "events": events}


def stage_samples(con: duckdb.DuckDBPyConnection, per_stage: int = STAGE_SAMPLE) -> dict[str, list[int]]:
    """Up to ``per_stage`` durations (ns) of every stage, reservoir-sampled, for the CDF plots."""
    out: dict[str, list[int]] = {}
    for stage in STAGES:
        rows = con.execute(f"""
            SELECT d FROM (SELECT {stage}_ns AS d FROM tasks WHERE {stage}_ns IS NOT NULL)
            USING SAMPLE reservoir({per_stage} ROWS) REPEATABLE (7)""").fetchall()
        if rows:
            out[stage] = sorted(r[0] for r in rows)
    return out


def _hol_overall(con: duckdb.DuckDBPyConnection, summary: QueryResult) -> dict[str, Any]:
    """HOL events over every configuration, built from ``hol_intervals`` exactly as ``hol_summary``
    builds its per-configuration rows (an event is a head; its duration the sum of its intervals)."""
    overall = _query(con, """
        WITH events AS (
            SELECT queue, head_correlation_id, sum(dur_ns) AS ns,
                   sum(dur_ns) FILTER (WHERE class = 'proven') AS proven_ns
            FROM hol_intervals GROUP BY ALL)
        SELECT count(*) AS events, count(proven_ns) AS proven_events,
               count(*) - count(proven_ns) AS possible_events,
               coalesce(sum(ns), 0) / 1e6 AS total_ms, coalesce(sum(proven_ns), 0) / 1e6 AS proven_total_ms,
               quantile_cont(ns, 0.5) / 1e6 AS p50_ms, quantile_cont(ns, 0.95) / 1e6 AS p95_ms,
               quantile_cont(ns, 0.99) / 1e6 AS p99_ms, max(ns) / 1e6 AS max_ms
        FROM events""").records()[0]
    dep_wait = sum(r["dep_wait_ms"] or 0.0 for r in summary.records())
    overall["dep_wait_ms"] = dep_wait
    overall["share"] = overall["proven_total_ms"] / dep_wait if dep_wait > 0 else None
    return overall


def timeline_data(con: duckdb.DuckDBPyConnection, max_tasks: int = DEFAULT_TIMELINE_TASKS) -> dict[str, Any]:
    """Tasks for the timeline views: per queue, a window of consecutive tasks around its longest HOL
    event. Times are microseconds since ``t0_ns`` (epoch ns do not fit a JavaScript number)."""
    queues = [r[0] for r in con.execute(
        "SELECT queue FROM tasks GROUP BY queue ORDER BY count(*) DESC, queue LIMIT $n",
        {"n": MAX_TIMELINE_QUEUES}).fetchall()]
    if not queues:
        return {"t0_ns": 0, "queues": [], "tasks": [], "hol": [], "shown": 0, "total": 0}
    per_queue = max(20, max_tasks // len(queues))
    centers = dict(con.execute("""
        SELECT queue, arg_max(head_seq, dur_ns) FROM hol_intervals GROUP BY queue""").fetchall())
    windows = []
    for queue in queues:
        center = centers.get(queue, per_queue // 2)
        lo = max(0, center - per_queue // 2)
        windows.append((queue, lo, lo + per_queue))
    con.execute("CREATE OR REPLACE TEMP TABLE _kvtrace_timeline_windows (queue VARCHAR, lo BIGINT, hi BIGINT)").fetchall()
    con.executemany("INSERT INTO _kvtrace_timeline_windows VALUES (?, ?, ?)", windows)
    stage_cols = ", ".join(f"{s}_start, {s}_end" for s in STAGES)
    dep_cols = ", ".join(f"ts_dep_{d}, ts_dep_{d}_lo, ts_dep_{d}_hi" for d in DEPS)
    cursor = con.execute(f"""
        SELECT t.queue, t.seq, t.correlation_id, t.step, t.layer_id, t.final_layer, t.outcome, t.ready_precision,
               t.ts_enqueue, t.ts_dequeue, t.ts_ready, t.ts_ready_lo, t.ts_complete, {stage_cols}, {dep_cols}
        FROM tasks AS t JOIN _kvtrace_timeline_windows AS w
          ON t.queue = w.queue AND t.seq >= w.lo AND t.seq < w.hi
        ORDER BY t.queue, t.seq""")
    columns = [d[0] for d in cursor.description]
    rows = [dict(zip(columns, row)) for row in cursor.fetchall()]
    total = con.execute("SELECT count(*) FROM tasks").fetchall()[0][0]
    if not rows:
        return {"t0_ns": 0, "queues": queues, "tasks": [], "hol": [], "shown": 0, "total": total}
    t0 = min(r["ts_enqueue"] for r in rows if r["ts_enqueue"] is not None)

    def us(ns: int | None) -> float | None:
        return None if ns is None else round((ns - t0) / 1e3, 3)

    tasks = []
    for r in rows:
        stages = [[s, us(r[f"{s}_start"]), us(r[f"{s}_end"])] for s in STAGES if r[f"{s}_start"] is not None]
        deps = {}
        for d in DEPS:
            if r[f"ts_dep_{d}"] is not None:
                deps[d] = us(r[f"ts_dep_{d}"])
            elif r[f"ts_dep_{d}_lo"] is not None or r[f"ts_dep_{d}_hi"] is not None:
                deps[d] = [us(r[f"ts_dep_{d}_lo"]), us(r[f"ts_dep_{d}_hi"])]
        tasks.append({
            "cid": r["correlation_id"], "queue": queues.index(r["queue"]), "seq": r["seq"], "step": r["step"],
            "layer": r["layer_id"], "final": bool(r["final_layer"]), "outcome": r["outcome"],
            "precision": r["ready_precision"], "enqueue": us(r["ts_enqueue"]), "dequeue": us(r["ts_dequeue"]),
            "ready": us(r["ts_ready"]), "ready_lo": us(r["ts_ready_lo"]), "complete": us(r["ts_complete"]),
            "stages": stages, "deps": deps,
        })
    hol = con.execute("""
        SELECT h.queue, h.head_correlation_id, h.class, h.start_ns, h.end_ns, h.evidence_correlation_id
        FROM hol_intervals AS h JOIN _kvtrace_timeline_windows AS w
          ON h.queue = w.queue AND h.head_seq >= w.lo AND h.head_seq < w.hi
        ORDER BY h.start_ns""").fetchall()
    return {
        "t0_ns": t0,
        "queues": queues,
        "tasks": tasks,
        "hol": [{"queue": queues.index(q), "head": head, "class": cls, "start": us(s), "end": us(e), "evidence": ev}
                for q, head, cls, s, e, ev in hol],
        "shown": len(tasks),
        "total": total,
    }
