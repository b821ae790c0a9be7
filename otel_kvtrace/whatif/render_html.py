"""The verdict report as one self-contained HTML page: inline CSS, charts as base64 PNG data URIs, no
network access and no script. Rendering only: every figure comes from the ``VerdictReport`` the
Markdown and JSON renderers use, and every text goes through ``html.escape``."""

from __future__ import annotations

import base64
import html
from collections.abc import Sequence
from pathlib import Path

from otel_kvtrace.report.html_safety import csp_meta
from otel_kvtrace.whatif.render import (
    DETAIL_LIMIT,
    VerdictReport,
    _best_gain,
    _f,
    _has_hol,
    _label,
    _range,
    chart_verdicts,
)
from otel_kvtrace.whatif.verdict import (
    KEEP,
    MAX_FIFO_ERROR_PCT,
    MIN_REPEATS,
    P99_TOLERANCE,
    ConfigVerdict,
)

_CSS = """
body { font-family: system-ui, sans-serif; margin: 1.2em; color: #222; max-width: 1400px; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; } h3 { font-size: 1em; margin-top: 1.4em; }
code { background: #f4f4f4; padding: 1px 4px; word-break: break-all; }
table.data { border-collapse: collapse; font-size: 0.82em; margin: 0.4em 0; }
table.data th, table.data td { border: 1px solid #ccc; padding: 2px 6px; text-align: right; vertical-align: top; }
table.data th { background: #f0f0f0; text-align: left; } table.data td.text { text-align: left; }
td.verdict, p.verdict { font-weight: bold; }
.switch { color: #006d2c; } .keep { color: #444; }
p.headline { font-weight: bold; padding: 0.5em; background: #fff4e5; border-left: 4px solid #e6550d; }
section.config { border-top: 1px solid #ddd; }
figure { display: inline-block; vertical-align: top; margin: 0.3em 0.6em 0.3em 0; } img.chart { max-width: 100%; border: 1px solid #ddd; }
ol.key { font-size: 0.85em; columns: 2; }
"""


def _e(value: object) -> str:
    return html.escape(str(value))


def _verdict_class(v: ConfigVerdict) -> str:
    return "keep" if v.verdict == KEEP else "switch"


def _row(cells: Sequence[tuple[str, str]]) -> str:
    """One table row from (text, css class) pairs; the text is escaped here."""
    return "<tr>" + "".join(f'<td class="{cls}">{_e(text)}</td>' if cls else f"<td>{_e(text)}</td>"
                            for text, cls in cells) + "</tr>"


def _head(names: Sequence[str]) -> str:
    return "<tr>" + "".join(f"<th>{_e(n)}</th>" for n in names) + "</tr>"


def _path_of(v: ConfigVerdict) -> str:
    return str(v.extra.get("path") or v.config.get("path") or "")


def _summary_table(group: Sequence[ConfigVerdict]) -> str:
    head = _head(["configuration", "runs", "FIFO err % (p95)", "HOL events/run", "HOL ms/run", "best gain LB ms",
                  "noise ms", "verdict", "reason"])
    rows = []
    for v in group:
        best, lb = _best_gain(v)
        rows.append(_row([
            (_label(v), "text"), (str(len(v.run_ids)), ""),
            (f"{_f(v.fifo_median_error_pct, 2)} ({_f(v.fifo_p95_error_pct, 1)})", ""),
            (", ".join(str(n) for n in v.hol_events), ""), (", ".join(_f(x, 2) for x in v.hol_ms), ""),
            (f"{best}: {_f(lb)}", ""), (_f(v.noise_ms), ""),
            (v.verdict, f"text verdict {_verdict_class(v)}"), (v.reason, "text reason"),
        ]))
    return f'<table class="data summary">{head}{"".join(rows)}</table>'


def _policy_table(v: ConfigVerdict) -> str:
    head = _head(["policy", "TTFT est. ms mean (min–max)", "TTFT stdev ms", "consumer wait ms/step mean (min–max)",
                  "consumer wait stdev ms", "p99 TTFT ms (max)", "peak in-flight (max)", "tasks/s",
                  "TTFT gain ms (min–max)"])
    rows = []
    for name, m in v.policies.items():
        gain = v.gains.get(name)
        rows.append(_row([
            (name, "text"), (_range(m["ttft_ms_mean"]), ""), (_f(m["ttft_ms_mean"]["stdev"]), ""),
            (_range(m["consumer_wait_ms_per_step"]), ""), (_f(m["consumer_wait_ms_per_step"]["stdev"]), ""),
            (_f(m["ttft_ms_p99"]["max"]), ""), (str(int(m["peak_inflight"]["max"])), ""),
            (_f(m["throughput_tasks_per_s"]["mean"], 0), ""), (_range(gain["ttft_gain_ms"]) if gain else "-", ""),
        ]))
    return f'<table class="data policies">{head}{"".join(rows)}</table>'


def _layer_table(v: ConfigVerdict) -> str:
    if not v.layers:
        return ""
    names = list(v.layers)
    head = _head(["layer"] + [f"{n} done / wait" for n in names])
    rows = []
    for layer in v.layers[names[0]]["layer"]:
        cells = [(str(int(layer)), "")]
        for n in names:
            prof = v.layers[n]
            j = prof["layer"].index(layer) if layer in prof["layer"] else -1
            cells.append((f"{_f(prof['load_done_ms'][j])} / {_f(prof['consumer_wait_ms'][j])}" if j >= 0 else "-", ""))
        rows.append(_row(cells))
    return ("<p>Per layer (means over runs, ms): load completion after the step's first enqueue / forward's "
            f'consumer wait.</p><table class="data layers">{head}{"".join(rows)}</table>')


def _detail(v: ConfigVerdict) -> str:
    config = ", ".join(f"<code>{_e(k)}={_e(val)}</code>" for k, val in v.config.items())
    state = "validated" if v.validated else "not validated: no policy compared"
    example = f" Example: {_e(v.extra['hol_example'])}." if v.extra.get("hol_example") else ""
    reproduce = f"<p>Reproduce: <code>{_e(v.reproduce)}</code></p>" if v.reproduce else ""
    return f"""<section class="config">
<h3>{_e(_label(v))}</h3>
<p>Configuration: {config}.</p>
{reproduce}
<p>Runs: {_e(", ".join(v.run_ids))}.</p>
<p>FIFO replay error: median {_f(v.fifo_median_error_pct, 2)}%, p95 {_f(v.fifo_p95_error_pct, 2)}% of service time,
pooled; worst run {_e(v.fifo_worst_run)} {_f(v.fifo_worst_run_error_pct, 2)}% ({_e(state)}).</p>
<p>HOL: {_e(", ".join(str(n) for n in v.hol_events))} event(s) per run, {_e(", ".join(_f(x, 3) for x in v.hol_ms))}
ms per run.{example}</p>
{_policy_table(v)}
{_layer_table(v)}
<p class="verdict {_verdict_class(v)}">Verdict: {_e(v.verdict)}: {_e(v.reason)}.</p>
</section>"""


def _charts(report: VerdictReport, pngs: Sequence[Path]) -> str:
    if not pngs:
        return ""
    figures = "".join(
        f'<figure><img class="chart" alt="{_e(p.stem)}" '
        f'src="data:image/png;base64,{base64.b64encode(p.read_bytes()).decode("ascii")}"></figure>'
        for p in pngs)
    key = "".join(f"<li>{_e(_label(v))} &rarr; {_e(v.verdict)}</li>" for v in chart_verdicts(report))
    return (f'<h2>Charts</h2><p>Configuration numbers in the charts (those with HOL first):</p>'
            f'<ol class="key">{key}</ol>{figures}')


def render_html(report: VerdictReport, *, pngs: Sequence[str | Path] = ()) -> str:
    """The whole page as a string; ``pngs`` (from ``write_pngs``) are inlined as data URIs."""
    switches = [v for v in report.verdicts if v.verdict != KEEP]
    model = ", ".join(f"{k}={v}" for k, v in report.model.items())
    notes = "".join(f"<li>{_e(n)}</li>" for n in report.notes)
    sections = []
    for path in sorted({_path_of(v) for v in report.verdicts}):
        group = [v for v in report.verdicts if _path_of(v) == path]
        detailed = group if len(report.verdicts) <= DETAIL_LIMIT else [v for v in group if _has_hol(v)]
        title = f"{path.upper()} path" if path else "Configurations"
        sections.append(f"<h2>{_e(title)}</h2>{_summary_table(group)}" + "".join(_detail(v) for v in detailed))
    limited = ("" if len(report.verdicts) <= DETAIL_LIMIT else
               f"<p>{len(report.verdicts)} configurations: details only for those with HOL.</p>")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">{csp_meta((), [_CSS])}<title>{_e(report.title)}</title>
<style>{_CSS}</style></head>
<body>
<h1>{_e(report.title)}</h1>
<p>Reproduce: <code id="reproduce">{_e(report.reproduce)}</code></p>
{f"<p>Replay model: {_e(model)}.</p>" if model else ""}
<p>Rules: FIFO replay must reproduce recorded completions in every run (median |error| &lt;=
{MAX_FIFO_ERROR_PCT:.0f}% of the median service time) before any policy is compared; switch only with HOL in
every run and when the TTFT gain's lower bound over &gt;= {MIN_REPEATS} runs is &gt; 0 and &gt; run-to-run noise
(stdev of FIFO's mean TTFT), with p99 TTFT at most {100 * P99_TOLERANCE:g}% above FIFO's and no peak in-flight
increase in any run.</p>
{f"<ul>{notes}</ul>" if notes else ""}
<p class="headline">{len(switches)} of {len(report.verdicts)} configuration(s) warrant a switch.</p>
{_charts(report, [Path(p) for p in pngs])}
{limited}
{"".join(sections)}
</body></html>
"""


def write_html(report: VerdictReport, path: str | Path, *, pngs: Sequence[str | Path] = ()) -> Path:
    """Write ``render_html(report, pngs=pngs)`` to ``path`` (UTF-8)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_html(report, pngs=pngs), encoding="utf-8")
    return out
