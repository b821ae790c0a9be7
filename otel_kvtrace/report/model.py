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
from otel_kvtrace.analyse.queries import QueryResult, drop_materialized, materialize, run_query
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
    hol_events: QueryResult  # one row per blocked head (queries/hol_events.sql)
    hol_overall: dict[str, Any]
    queue_depth: QueryResult  # per queue: max/mean depth and inflight
    consumer_stall: QueryResult  # per config: per-step consumer wait summary
    wait_explained: QueryResult
    wait_explained_total: int
    timeline: dict[str, Any] = field(default_factory=dict)
    stage_samples: dict[str, dict[str, list[int]]] = field(default_factory=dict)  # cfg -> stage -> ns
    pngs: dict[str, bytes] = field(default_factory=dict)  # rendered plots, filled by report.plots
    resources: dict[str, Any] = field(default_factory=dict)  # otel_kvtrace.resources.table.resource_report


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
    if not isinstance(paths, (LoadResult, str, Path)):
        paths = list(paths)  # read twice: traces, then the resource series beside them
    loaded = paths if isinstance(paths, LoadResult) else load_traces(
        paths, cache_dir=cache_dir, con=con, progress=progress)
    con = loaded.con
    if progress:
        progress("running queries ...")
    materialize(con, "hol_intervals")  # read by the summary, the overall figures, the timeline and JSON
    try:
        configs = run_query(con, "configs")
        summary = analyse.hol_summary(con)
        hol_overall = _hol_overall(con, summary)
        depth = run_query(con, "queue_depth_summary")
        stall = run_query(con, "consumer_stall_summary")
        unexplained = run_query(con, "wait_explained")
        explained_total = len(unexplained.rows)
        explained = QueryResult(unexplained.columns, unexplained.rows[:200])
        report = Report(
            stats=loaded.stats,
            configs=configs,
            stages=analyse.stage_breakdown(con),
            hol_summary=summary,
            hol_intervals=run_query(con, "hol_intervals"),
            hol_events=run_query(con, "hol_events"),
            hol_overall=hol_overall,
            queue_depth=depth,
            consumer_stall=stall,
            wait_explained=explained,
            wait_explained_total=explained_total,
        )
        report.timeline = timeline_data(con, timeline_tasks)
        report.timeline["npu"] = (npu_timeline(npu, report.timeline) if npu
                                  else {"lanes": [], "events": [], "run": None})
        report.stage_samples = stage_samples(con)
        if not isinstance(paths, LoadResult):  # resource series written beside the traces (or collected)
            from otel_kvtrace.resources.table import resource_report

            report.resources = resource_report([paths] if isinstance(paths, (str, Path)) else list(paths))
    finally:  # a later load into this connection must not meet stale intervals
        drop_materialized(con, "hol_intervals")
    return report


def npu_timeline(npu: NpuProfile, timeline: dict[str, Any]) -> dict[str, Any]:
    """The NPU profiler's slices that overlap the tasks shown, on the axis of the run they overlap
    most (each run's axis starts at its own 0), one lane per kind and stream/plane."""
    spans: dict[int, list[float]] = {}
    for t in timeline["tasks"]:
        run = timeline["queue_runs"][t["queue"]]
        ends = [s[2] for s in t["stages"]] + [t["enqueue"]]
        lo, hi = spans.get(run, [float("inf"), float("-inf")])
        spans[run] = [min(lo, t["enqueue"]), max(hi, max(ends))]
    best, best_overlap, window = None, 0, (0, 0)
    for run, (lo_us, hi_us) in spans.items():
        t0 = timeline["runs"][run]["t0_ns"]
        lo, hi = t0 + lo_us * 1e3, t0 + hi_us * 1e3
        overlap = sum(max(0, min(e.end_ns, hi) - max(e.start_ns, lo)) + (lo <= e.start_ns <= hi) for e in npu.events)
        if overlap > best_overlap:
            best, best_overlap, window = run, overlap, (lo, hi)
    if best is None:
        return {"lanes": [], "events": [], "run": None}
    t0 = timeline["runs"][best]["t0_ns"]
    lanes: list[str] = []
    events = []
    for e in npu.events:
        if e.end_ns < window[0] or e.start_ns > window[1]:
            continue
        lane = f"{e.kind} {e.lane}"
        if lane not in lanes:
            lanes.append(lane)
        events.append({"lane": lanes.index(lane), "kind": e.kind, "name": e.name,
                       "start": round((e.start_ns - t0) / 1e3, 3), "end": round((e.end_ns - t0) / 1e3, 3)})
    return {"lanes": lanes, "events": events, "run": best}


def stage_samples(con: duckdb.DuckDBPyConnection, per_stage: int = STAGE_SAMPLE) -> dict[str, dict[str, list[int]]]:
    """Per configuration, up to ``per_stage`` durations (ns) of every stage (``queries/stage_samples.sql``:
    a deterministic sample by the hash of the correlation id), for the per-configuration CDF plots."""
    out: dict[str, dict[str, list[int]]] = {}
    for cfg, stage, value in run_query(con, "stage_samples", {"stage_sample": per_stage}).rows:
        out.setdefault(cfg, {}).setdefault(stage, []).append(value)
    for stages in out.values():
        for values in stages.values():
            values.sort()
    return dict(sorted(out.items()))


def _hol_overall(con: duckdb.DuckDBPyConnection, summary: QueryResult) -> dict[str, Any]:
    """HOL events over every configuration (``queries/hol_overall.sql``, from the same ``hol_events``
    as the per-configuration summary) and the proven share of all dependency wait."""
    overall = run_query(con, "hol_overall").records()[0]
    dep_wait = sum(r["dep_wait_ms"] or 0.0 for r in summary.records())
    overall["dep_wait_ms"] = dep_wait
    overall["share"] = overall["proven_total_ms"] / dep_wait if dep_wait > 0 else None
    return overall


def timeline_data(con: duckdb.DuckDBPyConnection, max_tasks: int = DEFAULT_TIMELINE_TASKS) -> dict[str, Any]:
    """Tasks for the timeline views: per queue, a window of consecutive tasks around its longest HOL
    event; queues with the most HOL first. Times are microseconds since the first task shown of the
    task's run (``runs[i].t0_ns``): every run has its own axis starting at 0."""
    materialize(con, "timeline_windows", {"timeline_tasks": max_tasks, "timeline_queues": MAX_TIMELINE_QUEUES})
    try:
        windows = run_query(con, "timeline_windows")
        rows = run_query(con, "timeline_tasks").records()
        hol = run_query(con, "timeline_hol").rows
    finally:
        drop_materialized(con, "timeline_windows")
    queues = windows.column("queue")
    empty = {"runs": [], "queues": [], "queue_runs": [], "tasks": [], "hol": [], "shown": 0, "total": 0}
    if not queues:
        return empty
    if not rows:
        return {**empty, "queues": queues, "total": windows.column("total_tasks")[0]}
    runs: dict[str, dict[str, Any]] = {}
    for r in rows:
        if r["ts_enqueue"] is None:
            continue
        run = runs.setdefault(r["run_id"], {"run": r["run_id"], "cfg": r["cfg_label"], "t0_ns": r["ts_enqueue"]})
        run["t0_ns"] = min(run["t0_ns"], r["ts_enqueue"])
    run_ids = list(runs)
    queue_run = {r["queue"]: r["run_id"] for r in rows}
    tasks = [_timeline_task(r, queues.index(r["queue"]), runs[r["run_id"]]["t0_ns"]) for r in rows
             if r["run_id"] in runs]
    by_cid = {(t["queue"], t["cid"]): (t, r) for t, r in zip(tasks, (r for r in rows if r["run_id"] in runs))}
    hol_out = []
    for q, head, cls, s, e, ev, ev_ready in hol:
        t0 = runs[queue_run[q]]["t0_ns"]
        task, row = by_cid.get((queues.index(q), head), (None, None))
        hol_out.append({"queue": queues.index(q), "head": head, "class": cls, "start": _us(s, t0), "end": _us(e, t0),
                        "evidence": ev, "evidence_ready": _us(ev_ready, t0),
                        "head_ready": task["ready"] if task else None,
                        "blocked_by": _blocked_by(row, s) if row else "unknown"})
    return {
        "runs": [runs[r] for r in run_ids],
        "queues": queues,
        "queue_runs": [run_ids.index(queue_run[q]) if queue_run.get(q) in runs else 0 for q in queues],
        "tasks": tasks,
        "hol": hol_out,
        "shown": len(tasks),
        "total": windows.column("total_tasks")[0],
    }


def _us(ns: int | None, t0: int) -> float | None:
    return None if ns is None else round((ns - t0) / 1e3, 3)


def _timeline_task(r: dict[str, Any], queue: int, t0: int) -> dict[str, Any]:
    stages = [[s, _us(r[f"{s}_start"], t0), _us(r[f"{s}_end"], t0)] for s in STAGES if r[f"{s}_start"] is not None]
    deps: dict[str, Any] = {}
    for d in DEPS:
        if r[f"ts_dep_{d}"] is not None:
            deps[d] = _us(r[f"ts_dep_{d}"], t0)
        elif r[f"ts_dep_{d}_lo"] is not None or r[f"ts_dep_{d}_hi"] is not None:
            deps[d] = [_us(r[f"ts_dep_{d}_lo"], t0), _us(r[f"ts_dep_{d}_hi"], t0)]
    return {
        "cid": r["correlation_id"], "queue": queue, "seq": r["seq"], "step": r["step"],
        "layer": r["layer_id"], "final": bool(r["final_layer"]), "outcome": r["outcome"],
        "precision": r["ready_precision"], "enqueue": _us(r["ts_enqueue"], t0), "dequeue": _us(r["ts_dequeue"], t0),
        "ready": _us(r["ts_ready"], t0), "ready_lo": _us(r["ts_ready_lo"], t0), "complete": _us(r["ts_complete"], t0),
        "stages": stages, "deps": deps, "trace_id": r["trace_id"],
    }


_BLOCKERS = {"save_cpu_wait": "save", "save_npu_sync": "save", "gate_cond_wait": "gate", "gate_npu_sync": "gate",
             "slot_release_wait": "slot release"}


def _blocked_by(row: dict[str, Any], at_ns: int) -> str:
    """What the head waited for at ``at_ns``: the dependency-wait stage that holds that instant, named
    with its layer ("save of layer 1, shared buffer 1", "gate of layer 3", "slot release")."""
    for stage, what in _BLOCKERS.items():
        start, end = row[f"{stage}_start"], row[f"{stage}_end"]
        if start is None or not start <= at_ns <= end:
            continue
        if what == "save" and row["wait_for_save_layer"] is not None:
            buffer = _shared_buffer(row)
            return f"save of layer {row['wait_for_save_layer']}" + (f", shared buffer {buffer}" if buffer is not None else "")
        if what == "gate" and row["gate_id"] is not None:
            return f"gate of layer {row['gate_id']}"
        return what
    return "unknown"


def _shared_buffer(row: dict[str, Any]) -> int | None:
    """The shared buffer the task's layer loads into: vLLM-Ascend's simple layout gives the reused
    (non-independent) layers the buffers round-robin (``reused[s::B]``); None when the config does not
    say enough to tell."""
    n, b, layer = row["cfg_num_layers"], row["cfg_num_shared_buffers"], row["layer_id"]
    try:
        independent = {int(x) % n for x in str(row["cfg_independent_layers"] or "").split(",") if x.strip()}
    except (TypeError, ValueError, ZeroDivisionError):
        return None
    reused = [i for i in range(n or 0) if i not in independent]
    if not b or layer not in reused:
        return None
    return reused.index(layer) % b
