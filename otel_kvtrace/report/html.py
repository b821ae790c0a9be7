"""One self-contained HTML page: zoomable timeline, tables and plots, no network access needed.

Everything is inline: CSS, the small vanilla-JS SVG timeline (``timeline_js.py``), the
report data as a JSON script block and the plots as base64 PNG. Times in the data are microseconds
since the first task shown of each run (epoch nanoseconds do not fit a JavaScript number); the page
shows them in ms. Trace values are hostile input: see ``html_safety`` for how each context is escaped
and the page's security policy.
"""

from __future__ import annotations

import html
import re
from pathlib import Path

from otel_kvtrace.analyse.queries import QueryResult
from otel_kvtrace.report.html_safety import csp_meta, script_json
from otel_kvtrace.report.model import Report
from otel_kvtrace.report.plots import HOL_COLORS, STAGE_COLORS, pngs_html, report_pngs
from otel_kvtrace.report.terminal import hol_headline
from otel_kvtrace.report.timeline_js import TIMELINE_JS

_CSS = """
body { font-family: system-ui, sans-serif; margin: 1.2em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
table.data { border-collapse: collapse; font-size: 0.82em; margin: 0.4em 0; }
table.data th, table.data td { border: 1px solid #ccc; padding: 2px 6px; text-align: right; }
table.data th { background: #f0f0f0; } table.data td.text { text-align: left; }
#controls button { margin-right: 0.3em; }
#timeline-wrap { border: 1px solid #bbb; max-height: 620px; overflow-y: auto; overflow-x: hidden; cursor: grab; }
#timeline { display: block; user-select: none; }
#timeline rect.stage:hover { stroke: #000; stroke-width: 1; }
#timeline rect.selected { stroke: #000; stroke-width: 2; }
#timeline rect.evidence { stroke: #c00; stroke-width: 1.5; stroke-dasharray: 3 2; }
tr.hol-row { cursor: pointer; } tr.hol-row:hover { background: #fff4e5; }
#details { border: 1px solid #bbb; padding: 0.5em; margin-top: 0.6em; min-height: 3em; font-size: 0.9em; }
.legend span { display: inline-block; margin-right: 0.8em; font-size: 0.8em; }
.legend i { display: inline-block; width: 12px; height: 12px; margin-right: 3px; vertical-align: middle; }
.headline { font-weight: bold; padding: 0.5em; background: #fff4e5; border-left: 4px solid #e6550d; }
img.plot { max-width: 100%; border: 1px solid #ddd; margin: 0.3em 0; }
"""


def _cell(value: object, column: str) -> str:
    if value is None:
        text = "-"
    elif isinstance(value, float):
        text = f"{value:.3f}" if abs(value) < 1000 else f"{value:,.1f}"
    else:
        text = str(value)
    cls = ' class="text"' if isinstance(value, str) else ""
    return f"<td{cls}>{html.escape(text)}</td>"


def table_html(result: QueryResult, columns: list[str] | None = None, limit: int | None = None,
               table_id: str = "") -> str:
    columns = columns or result.columns
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join(
        "<tr>" + "".join(_cell(r[c], c) for c in columns) + "</tr>" for r in result.records()[:limit]
    )
    ident = f' id="{table_id}"' if table_id else ""
    return f'<table class="data"{ident}><tr>{head}</tr>{body}</table>'


def _legend_css() -> str:
    """Legend colours as classes: the page's policy refuses ``style`` attributes."""
    rules = [f".legend i.c-{s} {{ background: {c}; }}" for s, c in STAGE_COLORS.items()]
    rules += [f".legend i.c-hol-{k} {{ background: {c}; opacity: .35; }}" for k, c in HOL_COLORS.items()]
    return "\n".join(rules) + "\n"


def check_jaeger_url(url: str | None) -> None:
    """Raise ValueError unless ``url`` is None or a plain http(s) URL (it becomes a link's href)."""
    if url is not None and not re.fullmatch(r"https?://[^\s\"'<>]+", url):
        raise ValueError(f"--jaeger-url must be an http(s) URL, got {url!r}")


def render_html(report: Report, *, jaeger_url: str | None = None) -> str:
    """The whole page as a string; ``jaeger_url`` (http or https, e.g. ``http://localhost:16686``) adds
    an "open in Jaeger" link to each task's details."""
    check_jaeger_url(jaeger_url)
    timeline = report.timeline
    data_text = script_json({"timeline": timeline, "colors": STAGE_COLORS, "holColors": HOL_COLORS,
                             "jaeger": jaeger_url.rstrip("/") if jaeger_url else None})
    script = TIMELINE_JS
    css = _CSS + _legend_css()
    legend = "".join(f'<span><i class="c-{s}"></i>{html.escape(s)}</span>' for s in STAGE_COLORS)
    legend += "".join(f'<span><i class="c-hol-{k}"></i>HOL {html.escape(k)}</span>' for k in HOL_COLORS)
    plots = pngs_html(report_pngs(report))
    stats = report.stats
    malformed = "".join(f"<li>{html.escape(str(m))}</li>" for m in stats.malformed[:50])
    shown = (f"{timeline.get('shown', 0)} of {timeline.get('total', 0)} tasks shown "
             f"(a window around each queue's longest HOL event)")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">{csp_meta([script], [css])}<title>kvtrace report</title>
<style>{css}</style></head>
<body>
<h1>kvtrace report: head-of-line blocking in the KV recv queue</h1>
<p class="headline" id="headline">{html.escape(hol_headline(report))}</p>
<p>{stats.tasks} recv tasks, {stats.send_tasks} send tasks, {stats.spans} spans from {len(stats.files)} file(s);
{stats.malformed_count} malformed line(s) skipped; {stats.exporter_dropped} task record(s) dropped by the
exporters.</p>
{f'<ul id="malformed">{malformed}</ul>' if malformed else ''}
<h2>Timeline</h2>
<p>{html.escape(shown)}. Wheel: zoom, drag: pan, double-click: whole window. Click a task bar for its stages and
dependency times; the task that was ready behind it (the evidence) gets a dashed red outline.</p>
<div id="controls"><button id="zoom-in">+</button><button id="zoom-out">&minus;</button>
<button id="zoom-reset">reset</button><button id="zoom-all">whole window</button>
<label>run <select id="run-select"><option value="-1">all runs</option></select></label>
<input id="search" size="40" placeholder="correlation id (or part), Enter"><button id="search-go">find</button>
<span id="search-result"></span><span id="range"></span></div>
<div class="legend">{legend}</div>
<div id="timeline-wrap"><svg id="timeline" xmlns="http://www.w3.org/2000/svg"></svg></div>
<div id="details">Click a task.</div>
<h2>Head-of-line blocking</h2>
{table_html(report.hol_summary, table_id="hol-summary")}
<h3>Longest HOL intervals in the timeline</h3>
<p>Click a row: the timeline jumps to the interval, selects the head (solid outline) and the evidence
(dashed), and draws an arrow from the head to the evidence with a marker at each one's ready time
(filled: head, open: evidence). "Blocked by" is the dependency the head waited for.</p>
<table class="data" id="hol-intervals-table"><thead><tr><th>head</th><th>blocked by</th><th>class</th>
<th>start</th><th>duration</th><th>evidence (ready behind it)</th><th>evidence ready</th><th>run</th></tr></thead>
<tbody id="hol-intervals"></tbody></table>
<h2>Stages</h2>
{table_html(report.stages, table_id="stages")}
<h2>Queue depth</h2>
{table_html(report.queue_depth)}
<h2>Consumer stall per step</h2>
{table_html(report.consumer_stall)}
<h2>Plots</h2>
{plots}
<h2 id="not-explained">Tasks not explained by their stages within 1%: {report.wait_explained_total}</h2>
<p>A task is "not explained" when the sum of its recv-thread stage spans (queue wait through
completion) differs from its total time (enqueue to completion) by more than 1%. <i>gap</i>: time no
stage span covers (the recv thread did something that is not instrumented, or a span is missing);
<i>overlap</i>: stage spans claim the same time twice; <i>incomplete</i>: the task has no completion
time. These tasks are still counted in every table above; the list says where the stage breakdown
does not add up. {"First 50 shown, worst first." if report.wait_explained_total > 50 else ""}</p>
{table_html(report.wait_explained, limit=50)}
<script type="application/json" id="kvtrace-data">{data_text}</script>
<script>{script}</script>
</body></html>
"""


def write_html(report: Report, path: str | Path, *, jaeger_url: str | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_html(report, jaeger_url=jaeger_url), encoding="utf-8")
    return path
