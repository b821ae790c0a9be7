"""``report()``: the one call behind ``kvtrace report`` for Python users: build once, write the outputs
asked for, return the ``Report``.

Why: a notebook or a script wants "the report of these traces, as files" without re-deriving the CLI's
sequence (load, analyse, render each output from the same numbers).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rich.console import Console

from otel_kvtrace.load import LoadResult
from otel_kvtrace.report.html import write_html
from otel_kvtrace.report.json_out import write_json
from otel_kvtrace.report.model import Report, build_report
from otel_kvtrace.report.plots import write_pngs
from otel_kvtrace.report.terminal import render_terminal


def report(paths: Iterable[str | Path] | str | Path | LoadResult, *, json: str | Path | None = None,
           html: str | Path | None = None, png_dir: str | Path | None = None, jaeger_url: str | None = None,
           console: Console | None = None, written: list[Path] | None = None, **build: Any) -> Report:
    """Analyse ``paths`` once and write each output given; ``console`` also prints the terminal tables,
    ``written`` collects the paths written; ``build`` goes to ``build_report`` (``cache_dir``,
    ``timeline_tasks``, ``npu``, ...).

    Example::

        from otel_kvtrace.report import report
        r = report(["kvtrace-data/traces"], html="report.html", json="report.json")
        r.hol_overall["events"]
    """
    result = paths if isinstance(paths, Report) else build_report(paths, **build)
    out = written if written is not None else []
    if console is not None:
        render_terminal(result, console)
    if json is not None:
        out.append(write_json(result, json))
    if png_dir is not None:
        out += write_pngs(result, png_dir)
    if html is not None:
        out.append(write_html(result, html, jaeger_url=jaeger_url))
    return result
