"""Public entry points: ``whatif`` (recorded traces) and ``sweep_report`` (a finished sweep).

``kvtrace whatif`` and ``kvtrace sweep`` are thin shells over these and ``run_sweep``.
"""

from __future__ import annotations

import shlex
import statistics
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from otel_kvtrace.whatif.engine import FEEDBACKS
from otel_kvtrace.whatif.measured import compare, dispatch_cost_ns, measured_summary
from otel_kvtrace.whatif.saves import saves_from_duckdb
from otel_kvtrace.whatif.render import (
    VerdictReport,
    write_json,
    write_markdown,
    write_pngs,
)
from otel_kvtrace.whatif.render_html import write_html
from otel_kvtrace.whatif.replay import (
    RunSummary,
    config_key,
    group_runs,
    replay_run,
    write_task_times,
)
from otel_kvtrace.whatif.sweep import SweepResult
from otel_kvtrace.whatif.task import BOUNDS, tasks_from_duckdb
from otel_kvtrace.whatif.verdict import decide

MODEL_NOTES = [
    ("service time = recv-thread time excluding dependency waits (dispatch gap, meta_build, h2d_stagger, "
     "backend_submit, completion, untraced bookkeeping); dependency times are the recorded ones"),
    ("forward: reaches its first load wait at the recorded time, keeps its recorded compute gaps and wake-up "
     "lag; gates and saves move with the replayed forward"),
    "TTFT estimate = step's first enqueue -> forward leaves its last load wait",
    ("ready_queue pays its get()'s readiness checks per dequeue (decision_cost_us: the FIFO recording's waits "
     "that did not block); the forward and the send thread wake behind the recv thread's GIL runs"),
    ("a save's work before its NPU sync waits behind a recv build it meets (sized from FIFO's meetings); not "
     "modelled: its wait behind the forward's run (threaded replica, hol, ready_queue: about +21 us on save 5; "
     "docs/whatif.md, \"The final layer's miss\")"),
]

_CFG_COLUMNS = ("cfg_num_layers", "cfg_prefetch_layers", "cfg_num_shared_buffers", "cfg_independent_layers",
                "cfg_buffer_reuse", "path", "source")


def _configs(con: Any) -> dict[str, dict[str, Any]]:
    """``cfg_*`` columns per configuration key (``config_key(cfg_label, path)``)."""
    cols = {r[0] for r in con.execute("DESCRIBE tasks").fetchall()}
    present = [c for c in _CFG_COLUMNS if c in cols]
    if not present:
        return {}
    label = "cfg_label" if "cfg_label" in cols else "NULL"
    path = "path" if "path" in cols else "NULL"
    scheduler = "cfg_scheduler" if "cfg_scheduler" in cols else "NULL"
    sql = (f"SELECT {label}, {path}, {scheduler}, " + ", ".join(f"any_value({c})" for c in present)
           + " FROM tasks GROUP BY 1, 2, 3")
    return {config_key(row[0], row[1], row[2]): dict(zip(present, row[3:], strict=True))
            for row in con.execute(sql).fetchall()}


def _measured_runs(paths: Sequence[str | Path], where: str | None, bound: str,
                   say: Callable[[str], None]) -> dict[str, dict[str, list[RunSummary]]]:
    """Measured runs per configuration (``config_key`` without the scheduler) and recorded policy."""
    from otel_kvtrace.load import load_traces

    loaded = load_traces(list(paths), progress=say)
    out: dict[str, dict[str, list[RunSummary]]] = {}
    for label, runs in group_runs(tasks_from_duckdb(loaded.con, where=where, bound=bound)).items():
        for run_id, ts in runs.items():
            policy = ts[0].scheduler or "fifo"
            if policy == "fifo":
                raise ValueError(f"--measured: run {run_id!r} was recorded under fifo (kvtrace.cfg.scheduler "
                                 "missing or fifo); pass FIFO runs as PATHS")
            key = config_key(ts[0].cfg_label, ts[0].path)
            out.setdefault(key, {}).setdefault(policy, []).append(
                measured_summary(ts, run_id=run_id, cfg_label=key))
    return out


def whatif(
    paths: Sequence[str | Path],
    *,
    json_path: str | Path | None = None,
    md_path: str | Path | None = None,
    png_dir: str | Path | None = None,
    html_path: str | Path | None = None,
    tasks_csv: str | Path | None = None,
    policies: Sequence[str] | None = None,
    feedback: str = "full",
    bound: str = "hi",
    where: str | None = None,
    measured: Sequence[str | Path] | None = None,
    progress: Callable[[str], None] | None = None,
    gil_lag: bool = True,
) -> VerdictReport:
    """Load recorded traces, replay every queue of every run under each policy, decide per configuration.

    A configuration is a ``cfg_label`` (and path); its runs (``run_id``) are the independent repeats. Writes the
    JSON/Markdown/PNG/HTML outputs that are asked for (``html_path``: one self-contained page with the
    charts inlined; ``tasks_csv``: per-task start/complete under every policy) and returns the report.

    ``measured``: traces recorded under another policy (``kvtrace.cfg.scheduler``); each configuration
    with such runs gets ``extra["measured"]``: predicted vs measured per policy (:mod:`.measured`).
    ``gil_lag``: a policy's forward wake-up lags and the send thread's copy and build waits follow the recv
    thread's runs (:mod:`.gil`); False replays FIFO's recorded lags and save services (for comparison).

    Example: ``whatif(["kvtrace-data/traces"], md_path="verdict.md", json_path="verdict.json")``
    """
    from otel_kvtrace.load import load_traces

    if feedback not in FEEDBACKS:
        raise ValueError(f"feedback: must be one of {FEEDBACKS}, got {feedback!r}")
    if bound not in BOUNDS:
        raise ValueError(f"bound: must be one of {BOUNDS}, got {bound!r}")
    say = progress or (lambda _m: None)
    loaded = load_traces(list(paths), progress=say)
    tasks = tasks_from_duckdb(loaded.con, where=where, bound=bound)
    configs = _configs(loaded.con)
    saves = saves_from_duckdb(loaded.con)
    args = [str(p) for p in paths]
    for flag, value in (("--json", json_path), ("--md", md_path), ("--png-dir", png_dir), ("--html", html_path),
                        ("--tasks-csv", tasks_csv)):
        if value is not None:
            args += [flag, str(value)]
    for name in policies or ():
        args += ["--policy", name]
    for m in measured or ():
        args += ["--measured", str(m)]
    by_policy = _measured_runs(measured, where, bound, say) if measured else {}
    if policies and by_policy:
        policies = list(policies) + sorted({p for per in by_policy.values() for p in per} - set(policies))
    if feedback != "full":
        args += ["--feedback", feedback]
    if bound != "hi":
        args += ["--bound", bound]
    if where:
        args += ["--where", where]
    command = "kvtrace whatif " + shlex.join(args)
    verdicts = []
    replayed = []
    for label, runs in group_runs(tasks).items():
        say(f"replaying {label}: {len(runs)} run(s)")
        done = [replay_run(ts, policies=policies, feedback=feedback, run_id=run_id, cfg_label=label, saves=saves,
                           gil_lag=gil_lag)
                for run_id, ts in runs.items()]
        summaries = [r.summary() for r in done]
        costs = [ns for r in done for ns in r.decision_ns.values()]
        if tasks_csv is not None:
            replayed.extend(done)
        v = decide(summaries, cfg_label=label, config=configs.get(label, {}), reproduce=command)
        v.extra["path"] = str(configs.get(label, {}).get("path") or "")
        examples = [s.hol_example for s in summaries if s.hol_example]
        v.extra["hol_example"] = examples[0] if examples else ""
        v.extra["decision_cost_us"] = statistics.median(costs) / 1000 if costs else 0.0
        if label in by_policy:
            fifo_meas = [measured_summary(ts, run_id=run_id, cfg_label=label) for run_id, ts in runs.items()]
            v.extra["measured"] = []
            for name, runs_p in sorted(by_policy[label].items()):
                cost = dispatch_cost_ns(fifo_meas, runs_p)
                calibrated = [replay_run(ts, policies=[name], feedback=feedback, run_id=run_id, cfg_label=label,
                                         saves=saves, dispatch_ns={name: cost}, gil_lag=gil_lag).summary()
                              for run_id, ts in runs.items()] if cost else None
                v.extra["measured"].append(compare(summaries, fifo_meas, name, runs_p, cfg_label=label,
                                                   calibrated=calibrated, dispatch_ns=cost).to_dict())
        verdicts.append(v)
    missing = sorted(set(by_policy) - {v.cfg_label for v in verdicts})
    if missing:
        raise ValueError(f"--measured: no FIFO runs of configuration {missing[0]!r} among the FIFO traces")
    report = VerdictReport("What-if verdict on recorded traces", command, verdicts,
                           model={"feedback": feedback, "npu_bound": bound}, notes=list(MODEL_NOTES))
    _write(report, json_path, md_path, png_dir, html_path)
    if tasks_csv is not None:
        write_task_times(replayed, tasks_csv)
    return report


def sweep_report(
    result: SweepResult,
    *,
    json_path: str | Path | None = None,
    md_path: str | Path | None = None,
    png_dir: str | Path | None = None,
    html_path: str | Path | None = None,
) -> VerdictReport:
    """The verdict report of a sweep (defaults: ``verdict.json``, ``verdict.md`` and PNGs in its folder;
    the self-contained HTML page only when ``html_path`` is given)."""
    out = result.out_dir
    verdicts = list(result.verdicts)
    notes = list(MODEL_NOTES) + [
        "cells run on the replica's virtual clock, one run per seed; repeats differ by seed (lognormal jitter)"]
    if result.confirmation is not None:
        c = result.confirmation
        verdicts.append(c)
        notes.append(f"real-clock confirmation of {c.extra.get('slug')}: FIFO replay error "
                     f"{c.fifo_median_error_pct:.2f}% (p95 {c.fifo_p95_error_pct:.2f}%), {c.verdict}: {c.reason}")
    command = verdicts[0].reproduce if verdicts else f"kvtrace sweep --out {out} --report"
    report = VerdictReport("Coverage sweep: keep FIFO or switch?", command, verdicts,
                           model={"feedback": "full", "npu_bound": "exact (virtual clock)"}, notes=notes)
    _write(report, json_path or out / "verdict.json", md_path or out / "verdict.md", png_dir or out, html_path)
    _add_summary(result, Path(json_path or out / "verdict.json"), Path(md_path or out / "verdict.md"))
    return report


def _add_summary(result: SweepResult, json_path: Path, md_path: Path) -> None:
    """The sweep summary first: a ``summary`` key in the JSON and a "Summary" section atop the Markdown."""
    import json

    from otel_kvtrace.whatif.sweep import summary_lines, sweep_summary

    summary = sweep_summary(result)
    doc = json.loads(json_path.read_text())
    json_path.write_text(json.dumps({"summary": summary, **doc}, indent=1, default=str))
    text = md_path.read_text()
    head, _, rest = text.partition("\n")
    lines = "\n".join(f"- {line}" for line in summary_lines(summary)).replace("<", "&lt;")
    md_path.write_text(f"{head}\n\n## Summary\n\n{lines}\n{rest}")


def _write(report: VerdictReport, json_path: str | Path | None, md_path: str | Path | None,
           png_dir: str | Path | None, html_path: str | Path | None = None) -> None:
    pngs: list[Path] = write_pngs(report, png_dir) if png_dir is not None else []
    if html_path is not None:
        if png_dir is not None:
            write_html(report, html_path, pngs=pngs)
        else:  # the page inlines its charts, so they are drawn even when no PNG folder was asked for
            with tempfile.TemporaryDirectory(prefix="kvtrace-whatif-") as tmp:
                write_html(report, html_path, pngs=write_pngs(report, tmp))
    if json_path is not None:
        write_json(report, json_path)
    if md_path is not None:
        md = Path(md_path)
        names = []
        for p in pngs:
            try:
                names.append(str(p.resolve().relative_to(md.resolve().parent)))
            except ValueError:
                names.append(str(p.resolve()))
        write_markdown(report, md, png_names=names)
