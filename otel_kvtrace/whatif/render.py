"""Render verdicts: Markdown, PNG (matplotlib, headless) and JSON. Rendering only; no decisions here."""

from __future__ import annotations

import html
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from otel_kvtrace.whatif.verdict import (
    KEEP,
    MAX_FIFO_ERROR_PCT,
    MIN_REPEATS,
    P99_TOLERANCE,
    ConfigVerdict,
)

DETAIL_LIMIT = 20
"""Above this many configurations, per-configuration sections are written only for cells with HOL."""


@dataclass(slots=True)
class VerdictReport:
    """Everything a verdict report shows; ``to_dict`` is the JSON document."""

    title: str
    reproduce: str
    verdicts: list[ConfigVerdict]
    model: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "title": self.title,
            "reproduce": self.reproduce,
            "model": self.model,
            "rules": {"max_fifo_median_error_pct": MAX_FIFO_ERROR_PCT, "min_repeats": MIN_REPEATS,
                      "p99_tolerance": P99_TOLERANCE},
            "notes": self.notes,
            "configurations": [v.to_dict() for v in self.verdicts],
        }


def write_json(report: VerdictReport, path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report.to_dict(), indent=1, default=_json_default))
    return out


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, tuple | set):
        return list(value)
    return str(value)


def _f(value: float, digits: int = 3) -> str:
    return f"{value:.{digits}f}"


def _range(s: dict[str, Any], digits: int = 3) -> str:
    return f"{_f(s['mean'], digits)} ({_f(s['min'], digits)}–{_f(s['max'], digits)})"


def _best_gain(v: ConfigVerdict) -> tuple[str, float]:
    if not v.gains:
        return "-", 0.0
    name = max(v.gains, key=lambda n: v.gains[n]["lower_bound_ms"])
    return name, v.gains[name]["lower_bound_ms"]


def _has_hol(v: ConfigVerdict) -> bool:
    return any(n > 0 for n in v.hol_events)


_MD_PUNCT = re.compile(r"([\\`*_\[\]|~])")


def _md(value: Any) -> str:
    """``value`` (a label, run id, path, reason: anything a trace can set) as literal Markdown text: HTML
    escaped, Markdown punctuation backslash-escaped (``|`` too, so a table cell stays one cell), one line."""
    text = html.escape(" ".join(str(value).splitlines()), quote=False)
    return _MD_PUNCT.sub(r"\\\1", text)


def _code(value: Any) -> str:
    """``value`` as an inline code span (literal in Markdown and HTML renderers), one line."""
    return "`" + " ".join(str(value).splitlines()).replace("`", "'") + "`"


def markdown(report: VerdictReport, *, png_names: Sequence[str] = ()) -> str:
    """The Markdown report: reproduction command, model, summary table, per-configuration evidence."""
    lines = [f"# {_md(report.title)}", "", f"Reproduce: {_code(report.reproduce)}", ""]
    if report.model:
        lines.append("Replay model: " + ", ".join(f"{_md(k)}={_md(v)}" for k, v in report.model.items()) + ".")
    lines += [
        (f"Rules: FIFO replay must reproduce recorded completions in every run (median |error| <= "
         f"{MAX_FIFO_ERROR_PCT:.0f}% of the median service time) before any policy is compared; switch only "
         f"with HOL in every run and when the TTFT gain's lower bound over >= {MIN_REPEATS} runs is > 0 and > "
         f"run-to-run noise (stdev of FIFO's mean TTFT), with p99 TTFT at most {100 * P99_TOLERANCE:g}% above "
         "FIFO's and no peak in-flight increase in any run."), "",
    ]
    lines += [f"- {_md(n)}" for n in report.notes]
    if report.notes:
        lines.append("")
    switches = [v for v in report.verdicts if v.verdict != KEEP]
    lines += [f"**{len(switches)} of {len(report.verdicts)} configuration(s) warrant a switch.**", ""]
    for png in png_names:
        lines += [f"![{Path(png).stem}]({png})", ""]  # our own file names, not trace values
    paths = sorted({str(v.extra.get("path") or v.config.get("path") or "") for v in report.verdicts})
    for path in paths:
        group = [v for v in report.verdicts if str(v.extra.get("path") or v.config.get("path") or "") == path]
        lines += [f"## {_md(path.upper()) + ' path' if path else 'Configurations'}", ""]
        lines += [
            ("| configuration | runs | FIFO err % (p95) | HOL events/run | HOL ms/run | best gain LB ms | noise ms "
             "| verdict | reason |"),
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for v in group:
            best, lb = _best_gain(v)
            lines.append(
                f"| {_md(_label(v))} | {len(v.run_ids)} | {_f(v.fifo_median_error_pct, 2)} ({_f(v.fifo_p95_error_pct, 1)}) "
                f"| {', '.join(str(n) for n in v.hol_events)} | {', '.join(_f(x, 2) for x in v.hol_ms)} "
                f"| {_md(best)}: {_f(lb)} | {_f(v.noise_ms)} | **{_md(v.verdict)}** | {_md(v.reason)} |")
        lines.append("")
        detailed = group if len(report.verdicts) <= DETAIL_LIMIT else [v for v in group if _has_hol(v)]
        for v in detailed:
            lines += _detail(v)
    return "\n".join(lines) + "\n"


def _label(v: ConfigVerdict) -> str:
    extra = []
    for key in ("requests_per_step", "stress", "clock"):
        if key in v.config:
            extra.append(f"{key}={v.config[key]}")
    return v.cfg_label + (f" ({', '.join(extra)})" if extra else "")


def _detail(v: ConfigVerdict) -> list[str]:
    lines = [f"### {_md(_label(v))}", ""]
    lines.append("Configuration: " + ", ".join(_code(f"{k}={val}") for k, val in v.config.items()) + ".")
    if v.reproduce:
        lines.append(f"Reproduce: {_code(v.reproduce)}.")
    lines.append(f"Runs: {', '.join(_md(r) for r in v.run_ids)}.")
    state = "validated" if v.validated else "**not validated: no policy compared**"
    lines.append(f"FIFO replay error: median {_f(v.fifo_median_error_pct, 2)}%, p95 "
                 f"{_f(v.fifo_p95_error_pct, 2)}% of service time, pooled; worst run {_md(v.fifo_worst_run)} "
                 f"{_f(v.fifo_worst_run_error_pct, 2)}% ({state}).")
    lines.append(f"HOL: {', '.join(str(n) for n in v.hol_events)} event(s) per run, "
                 f"{', '.join(_f(x, 3) for x in v.hol_ms)} ms per run." +
                 (f" Example: {_md(v.extra['hol_example'])}." if v.extra.get("hol_example") else ""))
    lines += ["", ("| policy | TTFT est. ms mean (min–max) | consumer wait ms/step | p99 TTFT ms | peak in-flight "
                   "| tasks/s | TTFT gain ms (min–max) |"), "|---|---|---|---|---|---|---|"]
    for name, m in v.policies.items():
        gain = v.gains.get(name)
        lines.append(
            f"| {_md(name)} | {_range(m['ttft_ms_mean'])} | {_range(m['consumer_wait_ms_per_step'])} "
            f"| {_f(m['ttft_ms_p99']['max'])} | {int(m['peak_inflight']['max'])} "
            f"| {_f(m['throughput_tasks_per_s']['mean'], 0)} "
            f"| {_range(gain['ttft_gain_ms']) if gain else '-'} |")
    if v.layers:
        names = list(v.layers)
        layer_ids = v.layers[names[0]]["layer"]
        lines += ["", ("Per layer (means over runs, ms): load completion after the step's first enqueue / "
                       "forward's consumer wait."), "",
                  "| layer | " + " | ".join(f"{_md(n)} done / wait" for n in names) + " |",
                  "|---|" + "---|" * len(names)]
        for k, layer in enumerate(layer_ids):
            cells = []
            for n in names:
                prof = v.layers[n]
                j = prof["layer"].index(layer) if layer in prof["layer"] else -1
                cells.append(f"{_f(prof['load_done_ms'][j])} / {_f(prof['consumer_wait_ms'][j])}" if j >= 0 else "-")
            lines.append(f"| {int(layer)} | " + " | ".join(cells) + " |")
    lines += ["", f"**Verdict: {_md(v.verdict)}**: {_md(v.reason)}.", ""]
    return lines


def write_markdown(report: VerdictReport, path: str | Path, *, png_names: Sequence[str] = ()) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(markdown(report, png_names=png_names))
    return out


def chart_verdicts(report: VerdictReport, *, limit: int = 24) -> list[ConfigVerdict]:
    """The configurations the charts show, in chart order (numbered from 1): those with HOL first, then
    switches; the HTML page prints the same numbering as the key."""
    return sorted(report.verdicts, key=lambda v: (not _has_hol(v), v.verdict == KEEP))[:limit]


def write_pngs(report: VerdictReport, out_dir: str | Path, *, limit: int = 24) -> list[Path]:
    """``whatif_ttft.png`` (TTFT estimate per policy, min–max over runs), ``whatif_gain.png`` (gain
    lower bound vs noise), for up to ``limit`` configurations (those with HOL first), and
    ``whatif_layers.png`` (per-layer load completion and consumer wait, first four of them)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    chosen = chart_verdicts(report, limit=limit)
    if not chosen:
        return []
    names = list(chosen[0].policies) if chosen[0].validated else ["fifo"]
    labels = [f"{i + 1}" for i in range(len(chosen))]
    width = 0.8 / max(1, len(names))
    figsize = (max(6.0, 0.6 * len(chosen) + 2), 4.0)  # both charts: one bar group per configuration
    fig, ax = plt.subplots(figsize=figsize)
    for k, name in enumerate(names):
        xs, ys, lo, hi = [], [], [], []
        for i, v in enumerate(chosen):
            m = v.policies.get(name)
            if m is None:
                continue
            s = m["ttft_ms_mean"]
            xs.append(i + k * width)
            ys.append(s["mean"])
            lo.append(s["mean"] - s["min"])
            hi.append(s["max"] - s["mean"])
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=name)
    ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(chosen))], labels)
    ttft = _finish_chart(fig, ax, plt, out / "whatif_ttft.png", xlabel="configuration (numbers: whatif_configs.txt)",
                         ylabel="TTFT estimate, ms (mean, min–max over runs)", title="TTFT estimate per policy")

    fig, ax = plt.subplots(figsize=figsize)
    best = [_best_gain(v)[1] for v in chosen]
    noise = [v.noise_ms for v in chosen]
    colors = ["tab:green" if v.verdict != KEEP else "tab:gray" for v in chosen]
    ax.bar(range(len(chosen)), best, color=colors, label="best gain lower bound (green: switch)")
    ax.plot(range(len(chosen)), noise, "k_", markersize=14, label="run-to-run noise")
    ax.axhline(0, color="black", linewidth=0.5)
    ax.set_xticks(range(len(chosen)), labels)
    gain = _finish_chart(fig, ax, plt, out / "whatif_gain.png", xlabel="configuration", ylabel="ms",
                         title="TTFT gain lower bound vs noise")
    key = out / "whatif_configs.txt"
    key.write_text("".join(f"{i + 1}: {_label(v)} -> {v.verdict}\n" for i, v in enumerate(chosen)))
    layers = _layers_png(chosen[:4], out / "whatif_layers.png", plt)
    return [ttft, gain] + ([layers] if layers else [])


def _layers_png(verdicts: Sequence[ConfigVerdict], path: Path, plt: Any) -> Path | None:
    """Per layer, load completion (lines) and consumer wait (bars) per policy, one panel per configuration."""
    shown = [v for v in verdicts if v.layers]
    if not shown:
        return None
    fig, axes = plt.subplots(1, len(shown), figsize=(5.0 * len(shown), 3.8), squeeze=False)
    for ax, (k, v) in zip(axes[0], enumerate(shown), strict=True):
        names = list(v.layers)
        width = 0.8 / len(names)
        for j, name in enumerate(names):
            prof = v.layers[name]
            ax.plot(prof["layer"], prof["load_done_ms"], marker="o", label=f"{name} load done")
            ax.bar([x + (j - (len(names) - 1) / 2) * width for x in prof["layer"]], prof["consumer_wait_ms"], width,
                   alpha=0.4, label=f"{name} consumer wait")
        ax.set_title(f"{k + 1}: {v.cfg_label}"[:60], fontsize=8)
        ax.set_xlabel("layer")
        ax.set_ylabel("ms after the step's first enqueue / wait ms")
    axes[0][0].legend(fontsize=6)
    return _save_figure(fig, plt, path)


def _finish_chart(fig: Any, ax: Any, plt: Any, path: Path, *, xlabel: str, ylabel: str, title: str) -> Path:
    """Label a one-panel chart, add its legend and write it (the TTFT and gain charts share this)."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    return _save_figure(fig, plt, path)


def _save_figure(fig: Any, plt: Any, path: Path) -> Path:
    """Write ``fig`` as a 100 dpi PNG and free it (pyplot keeps every open figure otherwise)."""
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
