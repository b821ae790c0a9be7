"""Did async scheduling take effect? Metrics over the ``async_steps``/``async_spans`` tables and a verdict.

Definitions (docs/async_check.md):

- overlap ratio: over consecutive steps, the time of ``schedule(n+1)`` that falls inside
  ``execute(n)`` = [launch start(n), output ready(n)], divided by the total schedule time.
- forward gap: ``execute start(n+1) - output ready(n)`` clipped at 0 (device start when known, else
  the launch start, which bounds it from below): the device idles at least this long.
- blocking launch: the host launch covers >= 90% of [launch start, output ready]: the launch waited
  for the device (a synchronize in the launch path).
- exposed communication: communication time not covered by any compute interval; share = exposed / total.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import duckdb
import orjson

from otel_kvtrace.asynccheck import model as m
from otel_kvtrace.asynccheck.outcome import OutcomeMetrics, compute_outcome
from otel_kvtrace.asynccheck.tables import connect, load_run

EFFECTIVE_OVERLAP = 0.5
"""Overlap ratio from which async scheduling counts as effective."""
BLOCKING_LAUNCH_COVER = 0.9
"""A launch that covers this share of [launch start, output ready] waited for the device."""
BLOCKING_STEPS_SHARE = 0.5
MIN_PAIRS = 3
COMM_EXPOSED_NOTE = 0.3
HOST_BOUND_IDLE = 0.2
"""Device idle (gap p50) of at least this share of its busy time per step, with host work per step at
least the device's: host-bound, whatever the overlap."""
UPPER_BOUND_SHARE = 0.5
"""Steps whose ready time is only the engine's poll, from which an "effective" cannot be claimed."""

EFFECTIVE = "effective"
NOT_EFFECTIVE = "not effective"
CANNOT_TELL = "cannot tell"
UNREADABLE_WARNINGS = frozenset({"unsupported_file", "unsupported_db", "unsupported_csv"})
LOWER_BOUND_WARNINGS = frozenset({m.WARN_FORWARD_KIND_UNKNOWN, m.WARN_KERNELS_BY_TIME, m.WARN_NPU_SYNC_HOOKS})
"""Capture warnings under which the measured overlap is only a lower bound: a low value proves nothing."""

_PAIRS_CTE = """
WITH s AS (
  SELECT lane, step, launch_start, done,
         done - greatest(coalesce(worker_launch_start, launch_start), LAG(done) OVER w) AS busy_ns,
         (schedule_end - schedule_start) + (launch_end - launch_start) + (update_end - update_start) AS host_ns,
         LEAD(schedule_start) OVER w AS next_sched_start,
         LEAD(schedule_end) OVER w AS next_sched_end,
         LEAD(coalesce(device_start, worker_launch_start, launch_start)) OVER w AS next_exec_start
  FROM async_steps WHERE run = $run
  WINDOW w AS (PARTITION BY lane ORDER BY step)
), p AS (
  SELECT *, next_sched_end - next_sched_start AS sched_ns,
         greatest(0, least(next_sched_end, done) - greatest(next_sched_start, launch_start)) AS overlap_ns,
         CASE WHEN next_exec_start IS NOT NULL AND done IS NOT NULL
              THEN greatest(0, next_exec_start - done) END AS gap_ns,
         next_sched_start IS NOT NULL AND launch_start IS NOT NULL AND done IS NOT NULL
           AND next_sched_end > next_sched_start AS is_pair
  FROM s
)
"""
"""Per step pair (step n, step n+1 of one lane): overlap, forward gap, device busy and host time."""
_PAIRS_SQL = _PAIRS_CTE + """
SELECT count(*) FILTER (WHERE is_pair),
       sum(overlap_ns) FILTER (WHERE is_pair),
       sum(sched_ns) FILTER (WHERE is_pair),
       avg(CASE WHEN overlap_ns >= 0.5 * sched_ns THEN 1.0 ELSE 0.0 END) FILTER (WHERE is_pair),
       count(gap_ns),
       quantile_cont(gap_ns, 0.5) / 1e6,
       quantile_cont(gap_ns, 0.95) / 1e6,
       quantile_cont(busy_ns, 0.5) FILTER (WHERE busy_ns > 0) / 1e6,
       quantile_cont(host_ns, 0.5) / 1e6
FROM p
"""

_STEPS_SQL = """
SELECT count(*),
       count(schedule_start),
       count(done),
       count(*) FILTER (WHERE batch_queue),
       max(queue_depth),
       avg(CASE WHEN coalesce(worker_launch_end - worker_launch_start, launch_end - launch_start)
                     >= $cover * (done - coalesce(worker_launch_start, launch_start)) THEN 1.0 ELSE 0.0 END)
         FILTER (WHERE done > coalesce(worker_launch_start, launch_start) AND launch_end IS NOT NULL),
       avg(CASE WHEN done_precision IN ('engine_poll', 'engine_observed') THEN 1.0 ELSE 0.0 END)
         FILTER (WHERE done IS NOT NULL),
       count(worker_launch_start)
FROM async_steps WHERE run = $run
"""


@dataclass(slots=True)
class AsyncMetrics:
    """The numbers behind a verdict (None where the capture cannot provide them)."""

    steps: int = 0
    steps_with_schedule: int = 0
    steps_with_done: int = 0
    pairs: int = 0
    overlap_ratio: float | None = None
    overlapped_pairs_share: float | None = None
    gaps: int = 0
    gap_p50_ms: float | None = None
    gap_p95_ms: float | None = None
    device_busy_p50_ms: float | None = None
    host_p50_ms: float | None = None
    blocking_launch_share: float | None = None
    done_upper_bound_share: float | None = None
    """Share of steps whose output-ready time is only bounded by the engine's own poll."""
    worker_launch_steps: int = 0
    """Steps whose launch was seen in a ``MultiprocExecutor`` worker process (launch share, gap and device
    busy time are then measured from the worker's launch)."""
    max_queue_depth: int | None = None
    batch_queue_steps: int = 0
    comm_total_ms: float | None = None
    comm_exposed_ms: float | None = None
    comm_exposed_share: float | None = None


@dataclass(slots=True)
class CheckResult:
    """Verdict of one run with its reasons, metrics, markers, warnings and import problems."""

    run: str
    paths: list[str]
    verdict: str
    reasons: list[str]
    metrics: AsyncMetrics
    markers: dict[str, int] = field(default_factory=dict)
    warnings: list[dict[str, str]] = field(default_factory=list)
    import_errors: int = 0
    import_error_samples: list[dict[str, Any]] = field(default_factory=list)
    outcome: OutcomeMetrics = field(default_factory=OutcomeMetrics)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _merge(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def exposed_ns(comm: list[tuple[int, int]], compute: list[tuple[int, int]]) -> int:
    """Communication time not covered by the union of compute intervals."""
    covered = _merge(compute)
    total = 0
    for s, e in comm:
        exposed = e - s
        for cs, ce in covered:
            if ce <= s:
                continue
            if cs >= e:
                break
            exposed -= min(e, ce) - max(s, cs)
        total += max(0, exposed)
    return total


def step_gaps_ms(con: duckdb.DuckDBPyConnection, run: str) -> list[tuple[str, int, float]]:
    """``(lane, step n, forward gap after step n in ms)`` of every step with one: the values whose
    quantiles are the metrics' ``gap_p50_ms`` / ``gap_p95_ms``."""
    return con.execute(_PAIRS_CTE + "SELECT lane, step, gap_ns / 1e6 FROM p WHERE gap_ns IS NOT NULL ORDER BY lane, step",
                       {"run": run}).fetchall()


def compute_metrics(con: duckdb.DuckDBPyConnection, run: str) -> AsyncMetrics:
    """All metrics of one run from the loaded tables."""
    mt = AsyncMetrics()
    pairs, overlap, sched, overlapped, gaps, p50, p95, busy, host = con.execute(_PAIRS_SQL, {"run": run}).fetchone()
    mt.pairs, mt.gaps, mt.gap_p50_ms, mt.gap_p95_ms = pairs, gaps, p50, p95
    mt.device_busy_p50_ms, mt.host_p50_ms = busy, host
    if pairs and sched:
        mt.overlap_ratio, mt.overlapped_pairs_share = overlap / sched, overlapped
    row = con.execute(_STEPS_SQL, {"run": run, "cover": BLOCKING_LAUNCH_COVER}).fetchone()
    mt.steps, mt.steps_with_schedule, mt.steps_with_done, mt.batch_queue_steps, mt.max_queue_depth = row[:5]
    mt.blocking_launch_share, mt.done_upper_bound_share, mt.worker_launch_steps = row[5], row[6], row[7]
    rows = con.execute(
        "SELECT name, start_ns, end_ns FROM async_spans WHERE run = $run AND name IN ('communication', 'compute')",
        {"run": run},
    ).fetchall()
    comm = [(s, e) for n, s, e in rows if n == m.COMMUNICATION]
    compute = [(s, e) for n, s, e in rows if n == m.COMPUTE]
    if comm:
        total = sum(e - s for s, e in comm)
        mt.comm_total_ms = total / 1e6
        if compute and total:
            exposed = exposed_ns(comm, compute)
            mt.comm_exposed_ms, mt.comm_exposed_share = exposed / 1e6, exposed / total
    return mt


def verdict(mt: AsyncMetrics, markers: Mapping[str, int], warning_kinds: set[str]) -> tuple[str, list[str]]:
    """``effective`` / ``not effective`` / ``cannot tell`` and the reasons for it."""
    reasons: list[str] = []
    has_markers = any(markers.values())
    marker_text = ", ".join(f"{k} x{v}" for k, v in sorted(markers.items()) if v) or "none"
    if mt.pairs < MIN_PAIRS or mt.overlap_ratio is None:
        if mt.steps_with_schedule == 0:
            hint = (" (the domain filter dropped 'Schedule')" if m.WARN_SCHEDULE_DOMAIN_MISSING in warning_kinds
                    else "; forward.csv alone has none: add batch.csv" if m.WARN_SCHEDULE_MISSING in warning_kinds
                    else "; some files could not be read (see warnings and import errors)"
                    if warning_kinds & UNREADABLE_WARNINGS else "")
            reasons.append(f"no schedule spans in the capture{hint}")
        if mt.steps_with_done == 0:
            reasons.append("no output-ready (device completion) times: host launch spans alone cannot show overlap "
                           "(MindIE async 'forward' is a host launch); collect with acl_task_time=2 (MSPTI kernels) "
                           "or with our engine-loop instrumentation")
        if mt.steps_with_schedule and mt.steps_with_done:
            reasons.append(f"only {mt.pairs} consecutive step pairs with schedule and output-ready times "
                           f"(need {MIN_PAIRS})")
        if has_markers:
            reasons.append(f"async path markers present ({marker_text}), but overlap cannot be measured")
        return CANNOT_TELL, reasons
    pct = f"{mt.overlap_ratio:.0%}"
    gap_text = (f"forward gap p50 {mt.gap_p50_ms:.3f} ms, p95 {mt.gap_p95_ms:.3f} ms"
                if mt.gap_p50_ms is not None else "")
    host_bound = _host_bound(mt)
    bounded = (mt.done_upper_bound_share or 0.0) >= UPPER_BOUND_SHARE
    blocking = mt.blocking_launch_share or 0.0
    # in a MultiprocExecutor worker a blocking launch does not block the engine: schedule(n+1) still
    # overlaps, but the worker cannot queue step n+1's work while the device runs step n
    worker_waited = bool(mt.worker_launch_steps) and has_markers and blocking >= BLOCKING_STEPS_SHARE
    if mt.overlap_ratio >= EFFECTIVE_OVERLAP and bounded:
        return CANNOT_TELL, [
            f"cannot tell: output time bounded by the engine's own poll in {mt.done_upper_bound_share:.0%} of "
            f"steps (get_output ran on the engine thread, or was not seen): the measured overlap {pct} is an "
            "upper bound and the gap a lower bound. Trace the process that creates the async outputs "
            "(the worker process with MultiprocExecutor) so the copy-ready event can be watched",
            f"async markers: {marker_text}",
        ]
    if mt.overlap_ratio >= EFFECTIVE_OVERLAP and not host_bound and not worker_waited:
        reasons.append(f"schedule(n+1) overlaps execute(n) for {pct} of its time over {mt.pairs} step pairs")
        if m.WARN_NPU_SYNC_HOOKS in warning_kinds:
            reasons.append("measured although the capture's hooks synchronize the NPU (they can only shrink overlap)")
        if gap_text:
            reasons.append(gap_text)
        reasons.append(f"async markers: {marker_text}")
        verdict_ = EFFECTIVE
    elif warning_kinds & LOWER_BOUND_WARNINGS:
        why = ("the capture used hooks that synchronize the NPU, which serialise host and device"
               if m.WARN_NPU_SYNC_HOOKS in warning_kinds else "the output-ready times are only a lower bound")
        return CANNOT_TELL, [
            f"schedule(n+1) overlaps execute(n) for only {pct} of its time over {mt.pairs} step pairs, but {why} "
            "(see warnings): a low overlap does not show async was off",
            f"async markers: {marker_text}",
        ]
    else:
        verdict_ = NOT_EFFECTIVE
        waited_note = ""
        share = "" if mt.overlap_ratio >= EFFECTIVE_OVERLAP else "only "
        reasons.append(f"schedule(n+1) overlaps execute(n) for {share}{pct} of its time over {mt.pairs} step pairs")
        if not has_markers:
            reasons.append("no async markers: the engine ran the synchronous loop (async scheduling is off)")
        elif blocking >= BLOCKING_STEPS_SHARE:
            where = (" (in the worker process: the engine's schedule overlaps, but the worker cannot queue step "
                     "n+1 while the device runs step n)" if mt.worker_launch_steps else "")
            reasons.append(
                f"async path is on ({marker_text}) but the host launch returns only after the device output is "
                f"ready in {blocking:.0%} of steps{where}: a blocking synchronize in the launch path (synchronising "
                "profiler hooks, ASCEND_LAUNCH_BLOCKING=1, grammar bitmask .to('cpu'), need_timing)"
            )
            waited_note = ("the gap is a lower bound: the device also idles inside each step while the host "
                           "works between the blocking call's return and the output's copy, which no host "
                           "stamp sees (docs/async_check.md, Output-ready time)")
        elif host_bound:
            reasons.append(
                f"async path is on ({marker_text}) but the host is the bottleneck: schedule + launch + update take "
                f"{mt.host_p50_ms:.3f} ms per step (p50) while the device works {mt.device_busy_p50_ms:.3f} ms, so "
                f"the device idles {mt.gap_p50_ms:.3f} ms per step whatever the overlap"
            )
        else:
            reasons.append(
                f"async path is on ({marker_text}) but schedule(n+1) waits for step n's output "
                "(batch queue never holds 2 batches: deferred structured output or a full queue)"
            )
        if gap_text:
            reasons.append(f"{gap_text}: device idles between steps")
            if waited_note:
                reasons.append(waited_note)
        if bounded:
            reasons.append(f"output time bounded by the engine's own poll in {mt.done_upper_bound_share:.0%} of "
                           "steps: the overlap shown is an upper bound, so 'not effective' stands")
    if mt.comm_exposed_share is not None and mt.comm_exposed_share >= COMM_EXPOSED_NOTE:
        reasons.append(f"{mt.comm_exposed_share:.0%} of communication is exposed on the critical path")
    return verdict_, reasons


def _host_bound(mt: AsyncMetrics) -> bool:
    if mt.gap_p50_ms is None or mt.device_busy_p50_ms is None or mt.host_p50_ms is None:
        return False
    return (mt.gap_p50_ms >= HOST_BOUND_IDLE * mt.device_busy_p50_ms
            and mt.host_p50_ms >= mt.device_busy_p50_ms)


def _check_loaded(con: duckdb.DuckDBPyConnection, run: str, paths: Sequence[str | Path], result: m.ImportResult) -> CheckResult:
    mt = compute_metrics(con, run)
    markers: dict[str, int] = {}
    for mk in result.markers:
        markers[mk.marker] = markers.get(mk.marker, 0) + mk.count
    warnings = [{"kind": w.kind, "file": w.file, "message": w.message} for w in result.warnings]
    v, reasons = verdict(mt, markers, {w.kind for w in result.warnings})
    return CheckResult(
        run=run,
        paths=[str(p) for p in paths],
        verdict=v,
        reasons=reasons,
        metrics=mt,
        markers=markers,
        warnings=warnings,
        import_errors=len(result.issues),
        import_error_samples=[{"file": i.file, "line": i.line, "reason": i.reason} for i in result.issues[:20]],
        outcome=compute_outcome(con, run),
    )


def check(paths: Sequence[str | Path], *, run: str = "run", json_path: str | Path | None = None,
          con: duckdb.DuckDBPyConnection | None = None) -> CheckResult:
    """Load the capture files under ``paths`` as one run and decide whether async scheduling worked."""
    con = con if con is not None else connect()
    result = _check_loaded(con, run, paths, load_run(con, paths, run))
    if json_path is not None:
        Path(json_path).write_bytes(orjson.dumps(result.to_dict(), option=orjson.OPT_INDENT_2))
    return result


def compare(runs: Mapping[str, Sequence[str | Path]], *, json_path: str | Path | None = None,
            con: duckdb.DuckDBPyConnection | None = None) -> list[CheckResult]:
    """One ``CheckResult`` per labelled run, in the given order (baseline first)."""
    con = con if con is not None else connect()
    results = [_check_loaded(con, label, paths, load_run(con, paths, label)) for label, paths in runs.items()]
    if json_path is not None:
        Path(json_path).write_bytes(orjson.dumps([r.to_dict() for r in results], option=orjson.OPT_INDENT_2))
    return results
