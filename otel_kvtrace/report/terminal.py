"""Terminal rendering with rich: the full report and the short summary ``kvtrace demo`` ends with."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from otel_kvtrace.analyse.queries import QueryResult
from otel_kvtrace.load import LoadResult
from otel_kvtrace.report.format import num
from otel_kvtrace.report.model import Report, build_report


_TEXT_COLUMNS = ("cfg", "path", "stage", "queue", "class", "correlation_id", "intervals", "reason", "label")

_HEADERS = {
    "cfg": "#", "hol_events": "events", "proven_events": "proven", "possible_events": "possible",
    "hol_total_ms": "HOL ms", "hol_share_pct": "% of dep wait", "waiting_tasks": "waiting", "p50_ms": "p50",
    "p95_ms": "p95", "p99_ms": "p99", "max_ms": "max", "total_wait_ms": "wait ms",
    "after_ready_ms": "after ready", "step_p50_ms": "step p50", "step_p99_ms": "step p99",
    "step_max_ms": "step max", "dur_ms": "ms", "max_depth": "max depth", "mean_depth_at_enqueue": "mean depth",
    "max_inflight": "max in flight", "total_ms": "total ms", "explained_ms": "explained",
    "unexplained_ms": "unexplained", "correlation_id": "task", "intervals": "head / ready behind it", "label": "config label",
}
"""Short column headers (80 columns); the JSON output keeps the SQL column names. Every time is ms."""


def config_numbers(report: Report) -> dict[str | None, int]:
    """Config label -> its number in the legend (1-based, in the order of ``report.configs``)."""
    numbers: dict[str | None, int] = {}
    for label in report.configs.column("cfg_label"):
        numbers.setdefault(label, len(numbers) + 1)
    return numbers


def _table(title: str, records: list[dict[str, Any]], columns: list[str], limit: int | None = None) -> Table:
    """A table that fits 80 columns: no vertical rules, ids and labels fold (never cut), numbers keep
    their full width."""
    table = Table(title=Text(title, style="table.title"), title_justify="left", header_style="bold", box=box.SIMPLE_HEAD,
                  pad_edge=False, padding=(0, 1))
    rows = [[num(r.get(c)) for c in columns] for r in records[:limit]]
    for index, column in enumerate(columns):
        text = column in _TEXT_COLUMNS
        header = _HEADERS.get(column, column)
        widest = max([len(row[index]) for row in rows] + [1])
        table.add_column(header, justify="left" if text else "right", overflow="fold",
                         min_width=None if text else max(widest, min(len(header), 8)))
    for row in rows:
        table.add_row(*(Text(cell) for cell in row))  # trace values (labels, queues) are never markup
    return table


def _with_cfg(report: Report, result: QueryResult) -> list[dict[str, Any]]:
    numbers = config_numbers(report)
    return [{**r, "cfg": str(numbers.get(r.get("cfg_label"), "?"))} for r in result.records()]


def _legend(report: Report) -> Table:
    numbers = config_numbers(report)
    records = [{"cfg": str(numbers[r["cfg_label"]]), "path": r["path"], "queues": r["queues"], "tasks": r["tasks"],
                "label": r["cfg_label"] or "(no label)"} for r in report.configs.records()]
    return _table("Configurations (# in the tables below)", records, ["cfg", "path", "queues", "tasks", "label"])


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
            f"{share}; p50 {num(hol['p50_ms'])} ms, p99 {num(hol['p99_ms'])} ms per event.")


def render_terminal(report: Report, console: Console | None = None) -> None:
    """Every table of the report, laid out for 80 columns (configs numbered, see the legend)."""
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
            console.print(f"  {item}", markup=False, highlight=False)
        if stats.malformed_count > 10:
            console.print(f"  ... and {stats.malformed_count - 10} more (see --json)")
    console.print(_legend(report))
    console.print(_table("Stages (ms)", _with_cfg(report, report.stages),
                         ["cfg", "stage", "count", "p50_ms", "p95_ms", "p99_ms", "max_ms"]))
    summary = [{**r, "hol_share_pct": None if r["hol_share"] is None else 100 * r["hol_share"]}
               for r in _with_cfg(report, report.hol_summary)]
    console.print(_table("Head-of-line blocking (queries/hol_summary.sql)", summary,
                         ["cfg", "tasks", "waiting_tasks", "hol_events", "proven_events", "possible_events",
                          "hol_total_ms", "hol_share_pct"]))
    console.print(_table("HOL event duration (ms)", summary, ["cfg", "hol_events", "p50_ms", "p95_ms", "p99_ms",
                                                               "max_ms"]))
    if report.hol_intervals.rows:
        longest = sorted(_with_cfg(report, report.hol_intervals), key=lambda r: -r["dur_ns"])[:10]
        rows = [{**r, "dur_ms": r["dur_ns"] / 1e6,
                 "intervals": f"{r['head_correlation_id']}\n  ready: {r['evidence_correlation_id']}"}
                for r in longest]
        console.print(_table("Longest HOL intervals", rows, ["cfg", "class", "dur_ms", "intervals"]))
    console.print(_table("Queue depth", report.queue_depth.records(),
                         ["queue", "max_depth", "mean_depth_at_enqueue", "max_inflight"]))
    console.print(_table("Consumer stall per step (ms)", _with_cfg(report, report.consumer_stall),
                         ["cfg", "steps", "total_wait_ms", "after_ready_ms", "step_p50_ms", "step_p99_ms",
                          "step_max_ms"]))
    if report.wait_explained_total:
        console.print(_table(f"Tasks not explained by their stages within 1% ({report.wait_explained_total}; "
                             "gap: time no stage covers, overlap: stages claim the same time)",
                             report.wait_explained.records(),
                             ["correlation_id", "total_ms", "unexplained_ms", "reason"], limit=10))
    else:
        console.print("Every task's stages explain its total time within 1%.")
    console.print(Text(hol_headline(report), style="bold"), highlight=False)


def print_summary(source: Iterable[str | Path] | str | Path | LoadResult | Report,
                  console: Console | None = None) -> Report:
    """Print the short HOL summary (used by ``kvtrace demo``); ``source`` is trace paths, a
    ``LoadResult`` or a built ``Report``. Returns the report."""
    console = console or Console()
    report = source if isinstance(source, Report) else build_report(source)
    console.print(_legend(report))
    console.print(_table("Head-of-line blocking (ms)", _with_cfg(report, report.hol_summary),
                         ["cfg", "tasks", "hol_events", "proven_events", "hol_total_ms", "p50_ms", "p99_ms"]))
    console.print(Text(hol_headline(report)))
    return report
