"""Render an analysed trace set: rich terminal tables, JSON, PNG plots and one self-contained HTML page.

``report(paths, html=..., json=..., png_dir=...)`` is the one call (what ``kvtrace report`` does);
``build_report(paths)`` runs every analysis once and the renderers only format its ``Report``::

    from otel_kvtrace.report import report
    r = report(["kvtrace-data/traces"], html="report.html", json="report.json")

``print_summary(paths_or_result, console)`` prints the short HOL summary ``kvtrace demo`` ends with.
"""

from otel_kvtrace.report.html import render_html, write_html
from otel_kvtrace.report.json_out import report_to_dict, write_json
from otel_kvtrace.report.model import Report, build_report
from otel_kvtrace.report.outputs import report
from otel_kvtrace.report.perfetto import perfetto_trace, write_perfetto
from otel_kvtrace.report.plots import report_figures, write_pngs
from otel_kvtrace.report.terminal import hol_headline, print_summary, render_terminal

__all__ = [
    "Report",
    "build_report",
    "hol_headline",
    "perfetto_trace",
    "print_summary",
    "render_html",
    "render_terminal",
    "report",
    "report_figures",
    "report_to_dict",
    "write_html",
    "write_json",
    "write_perfetto",
    "write_pngs",
]
