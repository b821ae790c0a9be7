"""Matplotlib figures of a report: stage CDFs, HOL duration histogram and per-queue timelines with HOL
intervals shaded. Figures are built with the object API (``matplotlib.figure.Figure``), never pyplot, so
no backend or display is needed and a notebook's inline backend is left alone; each ``*_figure`` returns
a Figure (notebooks ``display`` it) and ``write_pngs`` saves them all."""

from __future__ import annotations

import base64
import html
import io
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path

from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from otel_kvtrace.load.tasks_sql import STAGES
from otel_kvtrace.report.model import Report

STAGE_COLORS: dict[str, str] = {
    "queue_wait": "#d9d9d9",
    "save_cpu_wait": "#e6550d",
    "save_npu_sync": "#fd8d3c",
    "gate_cond_wait": "#756bb1",
    "gate_npu_sync": "#9e9ac8",
    "meta_build": "#31a354",
    "h2d_stagger": "#a1d99b",
    "slot_release_wait": "#de2d26",
    "backend_submit": "#3182bd",
    "completion": "#6baed6",
    "consumer_wait": "#969696",
}
"""One color per stage, shared by the PNG and HTML timelines (dependency waits in warm colors)."""

HOL_COLORS = {"proven": "#ff0000", "possible": "#ffa500"}


def stage_cdf_figure(report: Report) -> Figure:
    """Empirical CDF of every stage's duration (log time axis), one panel per configuration: pooling
    configurations would hide exactly the differences a sweep is run for."""
    configs = list(report.stage_samples) or [""]
    fig = Figure(figsize=(9, 3.6 * len(configs) + 0.6))
    axes = fig.subplots(len(configs), 1, squeeze=False)[:, 0]
    for ax, cfg in zip(axes, configs):
        samples = report.stage_samples.get(cfg, {})
        for stage in STAGES:
            values = samples.get(stage)
            if not values:
                continue
            xs = [max(v, 1) / 1e6 for v in values]
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax.step(xs, ys, where="post", label=f"{stage} (n={len(values)})", color=STAGE_COLORS[stage])
        if not samples:
            ax.text(0.5, 0.5, "no stage spans", ha="center", va="center", transform=ax.transAxes, fontsize=14)
        else:
            ax.set_xscale("log")
            ax.legend(fontsize=7, loc="lower right")
        ax.set_xlabel("stage duration (ms, log)")
        ax.set_ylabel("fraction of tasks")
        ax.set_title(f"Stage duration CDFs: {cfg}" if cfg else "Stage duration CDFs")
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    return fig


def hol_event_durations_ms(report: Report) -> list[float]:
    """Per-event HOL duration (sum of a head's intervals, ``hol_events.sql``), ms."""
    return [ns / 1e6 for ns in report.hol_events.column("dur_ns")]


def hol_histogram_figure(report: Report) -> Figure:
    """Histogram of HOL event durations; says so plainly when there are none."""
    fig = Figure(figsize=(8, 4.5))
    ax = fig.subplots()
    durations = hol_event_durations_ms(report)
    if durations:
        ax.hist(durations, bins=min(60, max(5, len(durations) // 5)), color="#de2d26", alpha=0.8)
        ax.set_yscale("log")
        ax.set_ylabel("HOL events (log)")
    else:
        ax.text(0.5, 0.5, "no HOL events", ha="center", va="center", transform=ax.transAxes, fontsize=14)
    ax.set_xlabel("HOL duration per event (ms)")
    ax.set_title(f"HOL event durations ({len(durations)} events)")
    fig.tight_layout()
    return fig


def queue_timeline_figure(report: Report, queue_index: int = 0) -> Figure:
    """Tasks of one queue as rows of stage bars, HOL intervals shaded (from ``report.timeline``)."""
    timeline = report.timeline
    tasks = [t for t in timeline["tasks"] if t["queue"] == queue_index]
    rows = min(len(tasks), 400)
    tasks = tasks[:rows]
    fig = Figure(figsize=(12, max(3.0, min(12.0, 0.05 * rows + 2))))
    ax = fig.subplots()
    if not tasks:
        ax.text(0.5, 0.5, "no tasks", ha="center", va="center", transform=ax.transAxes)
        return fig
    t_min = min(t["enqueue"] for t in tasks)
    t_max = max(max(s[2] for s in t["stages"]) for t in tasks)
    by_stage: dict[str, list[tuple[float, float, int]]] = defaultdict(list)
    row_of = {}
    for row, task in enumerate(tasks):
        row_of[task["cid"]] = row
        for name, start, end in task["stages"]:
            if name != "consumer_wait":
                by_stage[name].append(((start - t_min) / 1e3, max(end - start, 0) / 1e3, row))
    for name, bars in by_stage.items():  # one collection per stage: thousands of bars draw in milliseconds
        boxes = [[(x, r - 0.4), (x + w, r - 0.4), (x + w, r + 0.4), (x, r + 0.4)] for x, w, r in bars]
        ax.add_collection(PolyCollection(boxes, facecolors=STAGE_COLORS.get(name, "#000"), linewidths=0))
    for hol in timeline["hol"]:
        if hol["queue"] != queue_index or hol["head"] not in row_of:
            continue
        ax.axvspan((hol["start"] - t_min) / 1e3, (hol["end"] - t_min) / 1e3, color=HOL_COLORS[hol["class"]],
                   alpha=0.12, lw=0)
    ax.set_xlim(0, (t_max - t_min) / 1e3)
    ax.set_ylim(rows, -1)
    ax.set_xlabel("time since first task shown (ms)")
    ax.set_ylabel("task (by seq)")
    ax.set_title(f"{timeline['queues'][queue_index]}: {rows} tasks, HOL shaded")
    handles = [Patch(color=c, label=s) for s, c in STAGE_COLORS.items() if s in by_stage]
    handles += [Patch(color=c, alpha=0.3, label=f"HOL {k}") for k, c in HOL_COLORS.items()]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig


def report_figures(report: Report) -> dict[str, Figure]:
    """Every figure by file stem."""
    figures = {"stage_cdf": stage_cdf_figure(report), "hol_durations": hol_histogram_figure(report)}
    for index, _queue in enumerate(report.timeline.get("queues", [])):
        figures[f"timeline_queue{index}"] = queue_timeline_figure(report, index)
    return figures


def report_pngs(report: Report) -> dict[str, bytes]:
    """Every figure as PNG bytes, rendered once per report (``--png-dir`` and ``--html`` share them)."""
    if not report.pngs:
        report.pngs = {stem: figure_png(fig) for stem, fig in report_figures(report).items()}
    return report.pngs


def figure_png(fig: Figure, dpi: int = 110) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


def pngs_html(pngs: Mapping[str, bytes], heading: str = "h3") -> str:
    """Each PNG as a ``<heading>`` with its stem and an inline ``data:`` image (the pages' policy allows
    images only from ``data:``); the stem is escaped."""
    return "".join(f'<{heading}>{html.escape(stem)}</{heading}><img class="plot" alt="{html.escape(stem)}" '
                   f'src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}">'
                   for stem, png in pngs.items())


def write_png_files(pngs: Mapping[str, bytes], out_dir: str | Path) -> list[Path]:
    """Save each PNG as ``<out_dir>/<stem>.png``; returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for stem, png in pngs.items():
        path = out / f"{stem}.png"
        path.write_bytes(png)
        paths.append(path)
    return paths


def write_pngs(report: Report, out_dir: str | Path) -> list[Path]:
    """Save every figure of ``report`` as ``<out_dir>/<stem>.png``; returns the paths."""
    return write_png_files(report_pngs(report), out_dir)
