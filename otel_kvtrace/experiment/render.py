"""Markdown and HTML views of the experiment report document (every value from a run is escaped)."""

from __future__ import annotations

import html
import re
from typing import Any

from otel_kvtrace.experiment.analysis import LABELS, level_order
from otel_kvtrace.report.html_safety import csp_meta

_SHADES = 10
"""Heatmap shades are classes ``hm0`` (white) .. ``hm10`` (deepest): the CSP allows no ``style=`` attribute."""
_SHADE_CSS = "".join(f".hm{k}{{background:rgb(255,{255 - 20 * k},{255 - 20 * k})}}" for k in range(_SHADES + 1))
_CELL_COLUMNS = ("cell", "runs ok", "TTFT p50/p95/p99 ms", "TTFT p50 noise", "tok/s (noise)", "HOL events/run",
                 "HOL ms/run (noise)", "queue wait ms", "consumer wait ms", "peak RSS MB", "peak NPU MB",
                 "peak in flight", "peak leases", "peak backend copies", "what-if")
AGGREGATION = ("Every percentile and mean is computed per run and averaged over the cell's ok runs (peaks: the "
               "maximum over runs); a wait stage that did not happen for a task counts 0 ms.")


def _f(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def cell_row(c: dict[str, Any]) -> list[str]:
    t = c["ttft_ms"]
    return [c["cell_id"], f"{c['runs_ok']}/{len(c['runs'])}", f"{_f(t['p50'])} / {_f(t['p95'])} / {_f(t['p99'])}",
            _f(c["ttft_p50_noise_ms"], 2), f"{_f(c['throughput_tok_s'])} ({_f(c['throughput_noise_tok_s'], 2)})",
            _f(c["hol"]["events"]), f"{_f(c['hol']['total_ms'])} ({_f(c['hol']['total_ms_noise'], 2)})",
            _f(c["queue_wait_ms"]), _f(c["consumer_wait_ms"]), _f(c["peak_host_rss_mb"]),
            _f(c.get("peak_npu_allocated_mb")), _f(c["peak_inflight_tasks"]), _f(c.get("peak_outstanding_leases")),
            _f(c.get("peak_backend_copies_pending")), c["whatif"]["verdict"] or c["whatif"]["reason"]]


STAGE_COLUMNS = ("cell", "where the recv tasks' time went")


def stage_row(c: dict[str, Any]) -> list[str]:
    from otel_kvtrace.experiment.report import stage_explanation

    return [c["cell_id"], stage_explanation(c)]


WAIT_COLUMNS = ("cell", "queue wait p50/p95/p99 ms", "dependency wait p50/p95/p99 ms", "HOL per event p50/p95/p99 ms")


def wait_row(c: dict[str, Any]) -> list[str]:
    w = c["wait_percentiles"]
    return [c["cell_id"], *(" / ".join(_f(w[k][q]) for q in ("p50", "p95", "p99"))
                            for k in ("queue_wait_ms", "dep_wait_ms", "hol_event_ms"))]


def effect_row(e: dict[str, Any]) -> list[str]:
    levels = "interaction" if ":" in e["factor"] else f"{_level(e['low'])} -> {_level(e['high'])}"
    if not e.get("balanced", True):
        levels += f" (in {e['contexts']} of {e['contexts_total']} sub-grids)"
    real = "yes" if e["real"] else "within noise" if e["effect"] is not None else "not estimable"
    return [e["factor"], levels, LABELS.get(e["metric"], e["metric"]), _f(e["effect"]), _f(e["noise"], 2), real]


def _level(value: Any) -> str:
    return "default" if value is None else str(value)


def _hkey(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def heatmap(doc: dict[str, Any], metric: str = "hol_total_ms") -> tuple[str, str, list[Any], list[Any], dict] | None:
    """(row factor, column factor, row levels, column levels, {(r, c): mean}) over the first two varying
    factors (B and P when both vary), averaging the other factors; ``None`` with fewer than two."""
    varying = [f for f in doc["factors"] if len({repr(c["config"].get(f)) for c in doc["cells"]}) >= 2]
    if len(varying) < 2:
        return None
    rf, cf = varying[0], varying[1]
    rows = [_level(v) for v in sorted({_hkey(c["config"].get(rf)) for c in doc["cells"]}, key=level_order)]
    cols = [_level(v) for v in sorted({_hkey(c["config"].get(cf)) for c in doc["cells"]}, key=level_order)]
    grid: dict[tuple[str, str], list[float]] = {}
    for c in doc["cells"]:
        value = c["hol"]["total_ms"] if metric == "hol_total_ms" else c["ttft_ms"]["p50"]
        if value is not None:
            grid.setdefault((_level(_hkey(c["config"].get(rf))), _level(_hkey(c["config"].get(cf)))), []).append(value)
    means = {k: sum(v) / len(v) for k, v in grid.items()}
    return rf, cf, rows, cols, means


_MD_SPECIAL = re.compile(r"([\\`*_\[\]()#!|~])")


def _md_escape(text: Any) -> str:
    """Inline text from a run: HTML-significant characters as entities, Markdown punctuation backslashed."""
    out = str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("\n", " ")
    return _MD_SPECIAL.sub(r"\\\1", out)


def _md_code(text: Any) -> str:
    """Inline code span that no backtick in ``text`` can close (CommonMark: a longer backtick run)."""
    body = str(text).replace("\n", " ")
    fence = "`" * (max((len(m) for m in re.findall(r"`+", body)), default=0) + 1)
    pad = " " if body.startswith("`") or body.endswith("`") else ""
    return f"{fence}{pad}{body}{pad}{fence}"


def _md_fence(lines: list[str], indent: str = "  ") -> list[str]:
    """A fenced block longer than any backtick run inside, so a ```` ``` ```` line in a log cannot close it."""
    longest = max((len(m) for line in lines for m in re.findall(r"`+", line)), default=0)
    fence = "`" * max(3, longest + 1)
    return [indent + fence, *(indent + x for x in lines), indent + fence]


def _md_table(header: list[str] | tuple[str, ...], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(_md_escape(x) for x in row) + " |" for row in rows]
    return out


def render_markdown(doc: dict[str, Any]) -> str:
    env = doc["environment"]
    lines = [f"# {_md_escape(doc['title'])}", "", "## Conclusion", "", _md_escape(doc["verdict"]), ""]
    lines += [f"- {_md_escape(d)}" for d in doc["verdict_details"]] + ["", "## Environment", ""]
    lines += [f"- {_md_escape(k)}: {_md_escape(v)}" for k, v in env.items()] + ["", "## Cells", ""]
    lines += _md_table(_CELL_COLUMNS, [cell_row(c) for c in doc["cells"]])
    lines += ["", AGGREGATION, "", "Wait percentiles per recv task (HOL: per event), averaged over runs:", ""]
    lines += _md_table(WAIT_COLUMNS, [wait_row(c) for c in doc["cells"]])
    lines += ["", "Stages, from each cell's own traces:", ""]
    lines += _md_table(STAGE_COLUMNS, [stage_row(c) for c in doc["cells"]])
    lines += _md_measured(doc)
    lines += ["", "## Factor effects", "",
              "Effect = mean at the high level minus mean at the low level (interaction: (hh - hl - lh + ll) / 2); "
              "noise = 95% half-width from the pooled run-to-run variance.", ""]
    lines += _md_table(["factor", "levels", "metric", "effect", "noise", "real"], [effect_row(e) for e in doc["factor_effects"]])
    for metric in ("hol_total_ms", "ttft_p50_ms"):
        hm = heatmap(doc, metric)
        if hm:
            rf, cf, rows, cols, means = hm
            lines += ["", f"## Heatmap: {LABELS[metric]} by {rf} (rows) x {cf} (columns)", ""]
            lines += _md_table([f"{rf} \\ {cf}", *cols], [[r, *(_f(means.get((r, c))) for c in cols)] for r in rows])
    lines += ["", "## Reproduce and raw timelines", ""]
    for c in doc["cells"]:
        lines += [f"### {_md_escape(c['cell_id'])}", "", f"- config: {_md_code(c['config'])}",
                  f"- command: {_md_code(c['command'])}"]
        for r in c["runs"]:
            lines.append(f"- run {r['run']}: {_md_escape(r['status'])}; traces {_md_code(r['traces'])} "
                         f"({_md_code('kvtrace report ' + str(r['traces']))}){'; ' + _md_escape(r['reason']) if r['reason'] else ''}")
            if r["status"] == "failed" and r.get("log_tail"):
                lines += ["", "  server log tail:", "", *_md_fence(r["log_tail"].splitlines()), ""]
        lines.append("")
    lines += ["## Stage definitions", "", "Queue wait, dependency waits (save CPU wait, save NPU sync, gate wait, "
              "gate NPU sync, slot release wait), metadata build, backend submit, completion and consumer wait are "
              "the child spans of each recv task (docs/schema.md); HOL is a head waiting while a later queued "
              "task is ready (docs/analysis.md). `kvtrace report <traces>` shows every stage table of a run.", ""]
    return "\n".join(lines)


def _h(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _html_table(header: list[str] | tuple[str, ...], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{_h(x)}</th>" for x in header)
    body = "".join("<tr>" + "".join(f"<td>{_h(x)}</td>" for x in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _html_heatmap(doc: dict[str, Any], metric: str) -> str:
    hm = heatmap(doc, metric)
    if not hm:
        return ""
    rf, cf, rows, cols, means = hm
    top = max(means.values(), default=0.0) or 1.0
    cells = []
    for r in rows:
        tds = []
        for c in cols:
            v = means.get((r, c))
            shade = 0 if v is None else round(_SHADES * min(1.0, max(0.0, v) / top))
            tds.append(f'<td class="hm hm{shade}">{_h(_f(v))}</td>')
        cells.append(f"<tr><th>{_h(r)}</th>{''.join(tds)}</tr>")
    head = "".join(f"<th>{_h(c)}</th>" for c in cols)
    return (f"<h2>Heatmap: {_h(LABELS[metric])} by {_h(rf)} (rows) x {_h(cf)} (columns)</h2>"
            f'<table class="heatmap" data-metric="{_h(metric)}"><thead><tr><th>{_h(rf)} \\ {_h(cf)}</th>{head}</tr>'
            f"</thead><tbody>{''.join(cells)}</tbody></table>")


def render_html(doc: dict[str, Any]) -> str:
    env = "".join(f"<li>{_h(k)}: {_h(v)}</li>" for k, v in doc["environment"].items())
    failed = []
    for c in doc["cells"]:
        for r in c["runs"]:
            if r["status"] != "ok":
                failed.append(f"<h3>{_h(c['cell_id'])} run {r['run']}: {_h(r['status'])}</h3><p>{_h(r['reason'])}</p>"
                              f"<pre>{_h(r.get('log_tail', ''))}</pre>")
    runs = "".join(f"<li><code>{_h(c['cell_id'])}</code>: <code>{_h(c['command'])}</code><ul>"
                   + "".join(f"<li>run {r['run']} {_h(r['status'])}: <code>{_h(r['traces'])}</code></li>" for r in c["runs"])
                   + "</ul></li>" for c in doc["cells"])
    style = ("body{font-family:sans-serif;margin:2em;max-width:90em}table{border-collapse:collapse;margin:1em 0}"
             "td,th{border:1px solid #ccc;padding:.3em .6em;text-align:right}td:first-child{text-align:left}"
             "pre{background:#f4f4f4;padding:.5em;overflow:auto}" + _SHADE_CSS)
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8">'
            f'{csp_meta(styles=[style])}<title>{_h(doc["title"])}</title>'
            f"<style>{style}</style></head><body><h1>{_h(doc['title'])}</h1>"
            f'<h2>Conclusion</h2><p id="verdict">{_h(doc["verdict"])}</p><ul>'
            + "".join(f"<li>{_h(d)}</li>" for d in doc["verdict_details"])
            + f"</ul><h2>Environment</h2><ul>{env}</ul><h2>Cells</h2>"
            + _html_table(_CELL_COLUMNS, [cell_row(c) for c in doc["cells"]])
            + f"<p>{_h(AGGREGATION)}</p>"
            + "<h2>Wait percentiles (per recv task; HOL per event; mean over runs)</h2>"
            + _html_table(WAIT_COLUMNS, [wait_row(c) for c in doc["cells"]])
            + "<h2>Stages (from each cell's traces)</h2>"
            + _html_table(STAGE_COLUMNS, [stage_row(c) for c in doc["cells"]])
            + _html_measured(doc)
            + "<h2>Factor effects</h2>"
            + _html_table(["factor", "levels", "metric", "effect", "noise", "real"], [effect_row(e) for e in doc["factor_effects"]])
            + _html_heatmap(doc, "hol_total_ms") + _html_heatmap(doc, "ttft_p50_ms")
            + (f"<h2>Failed runs</h2>{''.join(failed)}" if failed else "")
            + f"<h2>Reproduce and raw timelines</h2><ul>{runs}</ul></body></html>")


MEASURED_COLUMNS = ("FIFO cell", "policy", "policy cell", "predicted TTFT gain ms", "measured TTFT gain ms",
                    "noise ms", "gain error %", "measured verdict")


def measured_rows(doc: dict[str, Any]) -> list[list[str]]:
    rows = []
    for m in doc.get("measured_policies") or ():
        if m.get("error"):
            rows.append([m["fifo_cell"], m["policy"], m["policy_cell"], "-", "-", "-", "-", m["error"]])
            continue
        rows.append([m["fifo_cell"], m["policy"], m["policy_cell"], _f(m["predicted_gain_ms"]),
                     _f(m["measured_gain_ms"]), _f(m["noise_ms"], 2), _f(m["gain_error_pct"], 2),
                     f"{m['verdict']} ({m['reason']})"])
    return rows


def _md_measured(doc: dict[str, Any]) -> list[str]:
    rows = measured_rows(doc)
    if not rows:
        return []
    return ["", "## Measured policies (kvtrace whatif --measured)", "",
            "Predicted (replayed from the FIFO cell's runs) against measured (the policy cell's runs):", "",
            *_md_table(MEASURED_COLUMNS, rows)]


def _html_measured(doc: dict[str, Any]) -> str:
    rows = measured_rows(doc)
    if not rows:
        return ""
    return "<h2>Measured policies (kvtrace whatif --measured)</h2>" + _html_table(MEASURED_COLUMNS, rows)
