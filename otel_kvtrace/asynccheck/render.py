"""Rich terminal rendering of check, compare and doctor results (analysis returns data; this draws it)."""

from __future__ import annotations

from collections.abc import Sequence

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from otel_kvtrace.asynccheck.analysis import EFFECTIVE, NOT_EFFECTIVE, CheckResult
from otel_kvtrace.asynccheck.doctor import DoctorReport
from otel_kvtrace.asynccheck.outcome import outcome_line
from otel_kvtrace.report.format import num

_VERDICT_STYLE = {EFFECTIVE: "bold green", NOT_EFFECTIVE: "bold red"}
_STATUS_STYLE = {"ok": "green", "info": "cyan", "warn": "yellow", "error": "bold red"}


def _pct(value: float | None) -> str:
    return num(value, "{:.0%}")


def render_check(result: CheckResult, console: Console) -> None:
    style = _VERDICT_STYLE.get(result.verdict, "bold yellow")
    console.print(f"[{style}]async scheduling: {escape(str(result.verdict))}[/]  "
                  f"({escape(result.run)}: {escape(', '.join(map(str, result.paths)))})")
    for reason in result.reasons:
        console.print(f"  - {escape(reason)}")
    mt = result.metrics
    table = Table(title="metrics", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("steps", str(mt.steps)),
        ("step pairs with schedule + output-ready", str(mt.pairs)),
        ("overlap schedule(n+1) / execute(n)", _pct(mt.overlap_ratio)),
        ("pairs overlapped >= 50%", _pct(mt.overlapped_pairs_share)),
        ("forward gap p50 (ms)", num(mt.gap_p50_ms, "{:.3f}")),
        ("forward gap p95 (ms)", num(mt.gap_p95_ms, "{:.3f}")),
        ("launches that waited for the device", _pct(mt.blocking_launch_share)),
        ("max batches in flight", num(mt.max_queue_depth, "{}")),
        ("communication total (ms)", num(mt.comm_total_ms, "{:.3f}")),
        ("communication exposed", _pct(mt.comm_exposed_share)),
    ]
    for row in rows:
        table.add_row(*row)
    console.print(table)
    outcome = outcome_line(result.outcome)
    if outcome:
        console.print(f"outcome: {escape(outcome)}")
    if result.markers:
        console.print("async markers: " + escape(", ".join(f"{k} x{v}" for k, v in sorted(result.markers.items()))))
    for w in result.warnings:
        console.print(f"[yellow]warning[/] {escape(str(w['kind']))}: {escape(str(w['message']))}")
    if result.import_errors:
        console.print(f"[yellow]{result.import_errors} malformed rows skipped[/]")
        for issue in result.import_error_samples[:10]:
            console.print(f"  {issue['file']}:{issue['line']}: {issue['reason']}", markup=False, highlight=False)


def render_compare(results: Sequence[CheckResult], console: Console) -> None:
    """The ladder, readable at 80 columns: labels fold, the verdict never truncates; details follow per run."""
    table = Table(title="async scheduling, step by step", show_header=True, box=box.SIMPLE_HEAD, padding=(0, 1))
    table.add_column("run", overflow="fold", ratio=1)
    table.add_column("verdict", no_wrap=True, min_width=13)
    for col in ("overlap", "gap p50", "Δ p50", "comm exp", "waited"):
        table.add_column(col, justify="right", no_wrap=True)
    previous: float | None = None
    for r in results:
        mt = r.metrics
        delta = "-" if previous is None or mt.gap_p50_ms is None else f"{mt.gap_p50_ms - previous:+.2f}"
        style = _VERDICT_STYLE.get(r.verdict, "yellow")
        table.add_row(
            escape(r.run), f"[{style}]{escape(str(r.verdict))}[/]", _pct(mt.overlap_ratio), num(mt.gap_p50_ms, "{:.2f}"), delta,
            _pct(mt.comm_exposed_share), _pct(mt.blocking_launch_share),
        )
        previous = mt.gap_p50_ms if mt.gap_p50_ms is not None else previous
    console.print(table)
    console.print("gap p50 in ms; waited = launches that waited for the device; comm exp = communication exposed")
    for r in results:
        mt = r.metrics
        markers = ", ".join(sorted(k for k, v in r.markers.items() if v)) or "none"
        console.print(f"[bold]{escape(r.run)}[/]: gap p95 {num(mt.gap_p95_ms, '{:.2f}')} ms, max in flight "
                      f"{num(mt.max_queue_depth, '{}')}, markers {escape(markers)}")
        outcome = outcome_line(r.outcome)
        if outcome:
            console.print(f"  outcome: {escape(outcome)}")
        for reason in r.reasons:
            console.print(f"  - {escape(reason)}")
        for w in r.warnings:
            console.print(f"  [yellow]warning[/] {escape(str(w['kind']))}: {escape(str(w['message']))}")


def render_doctor(report: DoctorReport, console: Console) -> None:
    console.print(f"[bold]{escape(str(report.target))}[/]: {escape(' '.join(report.argv)[:200])}")
    table = Table(show_header=True)
    for col in ("status", "setting", "finding", "fix"):
        table.add_column(col)
    for f in report.findings:
        table.add_row(Text(f.status, style=_STATUS_STYLE[f.status]), Text(f.key), Text(f.message), Text(f.fix or ""))
    console.print(table)
    versions = ", ".join(f"{k} {v or 'not installed'}" for k, v in report.versions.items())
    console.print(f"versions ({report.versions_from}): {versions}", markup=False, highlight=False)
    for match in report.log_matches:
        console.print(f"  log line {match['line']}: {match['text']}", markup=False, highlight=False)
