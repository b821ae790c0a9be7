"""PNG and HTML curves of the async check, like msServiceProfiler's: step interval per step, request
latency, and the overlap timeline of BatchSchedule vs ModelExecute vs communication ("the switch took
effect" and "it paid off" side by side). Object-API figures (no pyplot); PNG encoding is the report's."""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path

import duckdb
from matplotlib.figure import Figure

from otel_kvtrace.asynccheck.analysis import CheckResult
from otel_kvtrace.report.format import num
from otel_kvtrace.report.html_safety import csp_meta
from otel_kvtrace.report.plots import figure_png, pngs_html

TIMELINE_STEPS = 6
"""Steps drawn per run in the overlap timeline (enough to see the pattern, few enough to read)."""


_STEP_INTERVAL_SQL = (
    "SELECT step, (LEAD(coalesce(device_start, launch_start)) OVER w - coalesce(device_start, launch_start)) / 1e6 "
    "FROM async_steps WHERE run = $run WINDOW w AS (PARTITION BY lane ORDER BY step) ORDER BY step")
_BATCH_SIZE_SQL = "SELECT step, batch_size FROM async_steps WHERE run = $run ORDER BY step"
_LATENCY_SQL = "SELECT latency_ms FROM async_requests WHERE run = $run ORDER BY latency_ms"


def _per_run_figure(con: duckdb.DuckDBPyConnection, runs: Sequence[str], sql: str, kind: str,
                    labels: tuple[str, str, str]) -> Figure | None:
    """One line per run of ``sql``'s ``(x, y)`` rows (``cdf``: one value column, drawn as its CDF);
    None when no run has a value."""
    fig = Figure(figsize=(8, 3.2))
    ax = fig.add_subplot()
    for run in runs:
        rows = [r for r in con.execute(sql, {"run": run}).fetchall() if r[-1] is not None]
        if not rows:
            continue
        if kind == "cdf":
            ax.plot([r[0] for r in rows], [(i + 1) / len(rows) for i in range(len(rows))], drawstyle="steps-post",
                    label=run)
        else:
            ax.plot([r[0] for r in rows], [r[1] for r in rows], marker="." if kind == "line" else None,
                    drawstyle="steps-post" if kind == "step" else "default", label=run)
    if not ax.lines:
        return None
    ax.set_xlabel(labels[0])
    ax.set_ylabel(labels[1])
    ax.set_title(labels[2])
    ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


def step_interval_figure(con: duckdb.DuckDBPyConnection, runs: Sequence[str]) -> Figure | None:
    return _per_run_figure(con, runs, _STEP_INTERVAL_SQL, "line",
                           ("step", "step interval (ms)", "decode speed: interval between consecutive steps"))


def batch_size_figure(con: duckdb.DuckDBPyConnection, runs: Sequence[str]) -> Figure | None:
    return _per_run_figure(con, runs, _BATCH_SIZE_SQL, "step", ("step", "batch size (requests)", "batch size per step"))


def request_latency_figure(con: duckdb.DuckDBPyConnection, runs: Sequence[str]) -> Figure | None:
    return _per_run_figure(con, runs, _LATENCY_SQL, "cdf",
                           ("request latency (ms)", "share of requests", "request latency (CDF)"))


def overlap_timeline_figure(con: duckdb.DuckDBPyConnection, runs: Sequence[str]) -> Figure:
    fig = Figure(figsize=(9, 1.4 + 1.1 * len(runs)))
    ax = fig.add_subplot()
    for i, run in enumerate(runs):
        steps = con.execute(
            "SELECT schedule_start, schedule_end, launch_start, coalesce(done, launch_end) FROM async_steps "
            "WHERE run = $run AND lane = (SELECT min(lane) FROM async_steps WHERE run = $run) ORDER BY step LIMIT $n",
            {"run": run, "n": TIMELINE_STEPS}).fetchall()
        times = [t for row in steps for t in row if t is not None]
        if not times:
            continue
        t0, t1 = min(times), max(times)
        comm = con.execute("SELECT start_ns, end_ns FROM async_spans WHERE run = $run AND name = 'communication' "
                           "AND end_ns >= $t0 AND start_ns <= $t1", {"run": run, "t0": t0, "t1": t1}).fetchall()
        y = 3 * (len(runs) - 1 - i)
        sched = [((a - t0) / 1e6, (b - a) / 1e6) for a, b, _, _ in steps if a is not None and b is not None]
        execs = [((a - t0) / 1e6, (b - a) / 1e6) for _, _, a, b in steps if a is not None and b is not None]
        ax.broken_barh(sched, (y + 2, 0.8), color="#3182bd", label="BatchSchedule" if i == 0 else None)
        for parity in (0, 1):  # alternate half-rows so that overlapping executes stay apart
            ax.broken_barh(execs[parity::2], (y + 1 + 0.45 * parity, 0.4), color=("#e6550d", "#fd8d3c")[parity],
                           label="ModelExecute (launch to output ready)" if i == 0 and not parity else None)
        ax.broken_barh([((a - t0) / 1e6, (b - a) / 1e6) for a, b in comm], (y, 0.8), color="#756bb1",
                       label="communication" if i == 0 else None)
        ax.text(0, y + 2.9, run, fontsize="small")
    ax.set_yticks([])
    ax.set_xlabel(f"ms since the first step shown (first {TIMELINE_STEPS} steps)")
    ax.set_title("overlap: schedule(n+1) under execute(n)")
    ax.legend(fontsize="x-small", loc="upper right")
    fig.tight_layout()
    return fig


def curve_pngs(con: duckdb.DuckDBPyConnection, results: Sequence[CheckResult]) -> dict[str, bytes]:
    """``stem -> PNG`` for every curve the data supports."""
    runs = [r.run for r in results]
    figures = {"step_interval": step_interval_figure(con, runs), "batch_size": batch_size_figure(con, runs),
               "request_latency": request_latency_figure(con, runs),
               "overlap_timeline": overlap_timeline_figure(con, runs)}
    return {stem: figure_png(fig) for stem, fig in figures.items() if fig is not None}


_STYLE = ("body{font-family:system-ui,sans-serif;margin:1.2em}td,th{border:1px solid #ccc;padding:2px 6px}"
          "table{border-collapse:collapse}img{max-width:100%}")


def write_html(pngs: dict[str, bytes], results: Sequence[CheckResult], path: str | Path) -> Path:
    """One self-contained page: a verdict and outcome table per run, then the curves (every value escaped)."""
    rows = []
    for r in results:
        o = r.outcome
        ms = (r.metrics.gap_p50_ms, o.step_interval_p50_ms, o.step_interval_p99_ms, o.request_latency_p90_ms,
              o.request_latency_p99_ms)
        cells = [r.run, r.verdict, num(r.metrics.overlap_ratio, "{:.0%}"), *(num(v, "{:.2f}") for v in ms),
                 num(o.output_tokens_per_s, "{:.1f}")]
        rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    head = ("run", "verdict", "overlap", "gap p50 ms", "step p50 ms", "step p99 ms", "latency p90 ms",
            "latency p99 ms", "tokens/s")
    imgs = pngs_html(pngs, "h2")
    page = ("<!doctype html><html><head><meta charset='utf-8'>" + csp_meta(styles=[_STYLE])
            + f"<title>kvtrace async check</title><style>{_STYLE}</style>"
            "</head><body><h1>Async scheduling: did it take effect, did it pay off?</h1><table><tr>"
            + "".join(f"<th>{h}</th>" for h in head) + "</tr>" + "".join(rows) + "</table>" + imgs + "</body></html>")
    out = Path(path)
    out.write_text(page, encoding="utf-8")
    return out
