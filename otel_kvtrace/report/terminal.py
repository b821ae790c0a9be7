"""Terminal rendering with rich: the full report and the short summary ``kvtrace demo`` ends with."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from otel_kvtrace.analyse.queries import QueryResult
from otel_kvtrace.load import LoadResult
from otel_kvtrace.report.model import Report, build_report


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 1000 else f"{value:,.1f}"
    return str(value)


_TEXT_COLUMNS = ("cfg_label", "path", "stage", "queue", "class", "correlation_id", "head_correlation_id",
                 "evidence_correlation_id", "reason")


_HEADERS = {
    "cfg_label": "config", "hol_events": "HOL events", "proven_events": "proven", "possible_events": "possible",
    "hol_total_ms": "HOL ms", "hol_share": "share of dep. wait", "waiting_tasks": "waiting", "p50_ms": "p50 ms",
    "p95_ms": "p95 ms", "p99_ms": "p99 ms", "max_ms": "max ms", "total_wait_ms": "total wait ms",
    "after_ready_ms": "after ready ms", "step_p50_ms": "step p50 ms", "step_p99_ms": "step p99 ms",
    "step_max_ms": "step max ms", "head_correlation_id": "head", "evidence_correlation_id": "evidence",
    "dur_ns": "duration ns", "max_depth": "max depth", "mean_depth_at_enqueue": "mean depth at enqueue",
    "max_inflight": "max in flight", "total_ms": "total ms", "explained_ms": "explained ms",
    "unexplained_ms": "unexplained ms", "correlation_id": "task",
}
"""Readable column headers; the JSON output keeps the SQL column names."""


def short_id(correlation_id: str) -> str:
    """The distinguishing tail of a correlation id (``.../gva/s12/l3``) for narrow terminals."""
    parts = correlation_id.split("/")
    return correlation_id if len(parts) <= 3 else ".../" + "/".join(parts[-3:])


def _table(title: str, result: QueryResult, columns: list[str], limit: int | None = None) -> Table:
    """A rich table; a config/path column with one value only moves into the title to save width."""
    records = result.records()
    shown = list(columns)
    for column in ("cfg_label", "path", "queue"):
        values = {r.get(column) for r in records}
        if column in shown and len(values) == 1 and len(records) > 0:
            shown.remove(column)
            title += f" [{column}: {values.pop()}]"
    table = Table(title=title, title_justify="left", header_style="bold")
    for column in shown:
        text = column in _TEXT_COLUMNS
        table.add_column(_HEADERS.get(column, column), justify="left" if text else "right",
                         ratio=3 if column == "cfg_label" else None, overflow="fold" if text else "ellipsis")
    for record in records[:limit]:
        table.add_row(*(short_id(record[c]) if c.endswith("correlation_id") and record[c] else _fmt(record[c])
                        for c in shown))
    return table


def hol_headline(report: Report) -> str:
    """One sentence answering "is there HOL blocking here, and how much?"."""
    hol = report.hol_overall
    if not report.stats.tasks:
        return (f"No recv tasks in these traces ({report.stats.send_tasks} send tasks, {report.stats.spans} "
                "spans): there is no recv queue to analyse.")
    if not hol["events"]:
        return (f"No head-of-line blocking: in {report.stats.tasks} tasks no head waited on a dependency while "
                "a later task of its queue was ready.")
    share = f", {100 * hol['share']:.1f}% of dependency wait" if hol.get("share") is not None else ""
    return (f"HOL blocking found: {hol['events']} events ({hol['proven_events']} proven, "
            f"{hol['possible_events']} possible) in {report.stats.tasks} tasks, {hol['total_ms']:.3f} ms in total"
            f"{share}; p50 {_fmt(hol['p50_ms'])} ms, p99 {_fmt(hol['p99_ms'])} ms per event.")


def render_terminal(report: Report, console: Console | None = None) -> None:
    """Every table of the report."""
    console = console or Console()
    stats = report.stats
    console.print(f"[bold]Loaded[/] {stats.tasks} recv tasks, {stats.send_tasks} send tasks, {stats.spans} spans "
                  f"from {len(stats.files)} file(s) in {stats.seconds:.2f} s (cache: {stats.cache}).")
    if stats.exporter_dropped:
        console.print(f"[yellow]The exporters reported {stats.exporter_dropped} dropped task record(s): "
                      "those tasks are missing from every table below.[/]")
    if stats.duplicate_tasks:
        console.print(f"[yellow]{stats.duplicate_tasks} task(s) appear more than once (same trace id): "
                      "the same traces were loaded twice, or a task was exported twice.[/]")
    if stats.malformed:
        console.print(f"[yellow]Skipped {stats.malformed_count} malformed line(s)/span(s):[/]")
        for item in stats.malformed[:10]:
            console.print(f"  {item}")
        if stats.malformed_count > 10:
            console.print(f"  ... and {stats.malformed_count - 10} more (see --json)")
    console.print(_table("Stages (ms)", report.stages,
                         ["cfg_label", "path", "stage", "count", "p50_ms", "p95_ms", "p99_ms", "max_ms"]))
    console.print(_table("Head-of-line blocking (queries/hol_summary.sql)", report.hol_summary,
                         ["cfg_label", "path", "tasks", "waiting_tasks", "hol_events", "proven_events",
                          "possible_events", "hol_total_ms", "p50_ms", "p95_ms", "p99_ms", "hol_share"]))
    if report.hol_intervals.rows:
        longest = QueryResult(report.hol_intervals.columns,
                              sorted(report.hol_intervals.rows,
                                     key=lambda r: -r[report.hol_intervals.columns.index("dur_ns")])[:10])
        console.print(_table("Longest HOL intervals", longest,
                             ["head_correlation_id", "class", "dur_ns", "evidence_correlation_id"]))
    console.print(_table("Queue depth", report.queue_depth,
                         ["queue", "max_depth", "mean_depth_at_enqueue", "max_inflight"]))
    console.print(_table("Consumer stall per step (ms)", report.consumer_stall,
                         ["cfg_label", "path", "steps", "total_wait_ms", "after_ready_ms", "step_p50_ms",
                          "step_p99_ms", "step_max_ms"]))
    if report.wait_explained_total:
        console.print(_table(f"Tasks not explained by their stages within 1% ({report.wait_explained_total})",
                             report.wait_explained,
                             ["correlation_id", "total_ms", "explained_ms", "unexplained_ms", "reason"], limit=10))
    else:
        console.print("Every task's stages explain its total time within 1%.")
    console.print(f"[bold]{hol_headline(report)}[/]")


def print_summary(source: Iterable[str | Path] | str | Path | LoadResult | Report,
                  console: Console | None = None) -> Report:
    """Print the short HOL summary (used by ``kvtrace demo``); ``source`` is trace paths, a
    ``LoadResult`` or a built ``Report``. Returns the report."""
    console = console or Console()
    report = source if isinstance(source, Report) else build_report(source)
    console.print(_table("Head-of-line blocking", report.hol_summary,
                         ["cfg_label", "path", "tasks", "hol_events", "proven_events", "hol_total_ms",
                          "p50_ms", "p99_ms"]))
    console.print(hol_headline(report))
    return report
