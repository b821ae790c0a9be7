"""``kvtrace experiment DIR --report``: ``report.json`` (the contract), ``report.md`` and ``report.html``.

``report.json`` keys (tests and tools read them): ``environment``; ``cells`` (each with ``cell_id``,
``config``, ``command``, ``runs`` [per run: ``run``, ``status``, ``reason``, ``traces``, metrics],
``ttft_ms`` {p50, p95, p99} (each run's percentile, averaged over the cell's ok runs), ``ttft_p50_noise_ms``,
``throughput_tok_s`` (mean over runs) and ``throughput_noise_tok_s``, ``hol`` {events, total_ms} (mean per
run) with ``total_ms_noise``, ``queue_wait_ms``, ``consumer_wait_ms``, ``wait_percentiles`` (queue wait, dependency wait per task and HOL per event,
{p50, p95, p99} ms averaged over runs), ``stage_ms`` (mean ms per recv task of each stage, over runs),
``peak_host_rss_mb``, ``peak_npu_allocated_mb``, ``peak_inflight_tasks``, ``peak_outstanding_leases``,
``peak_backend_copies_pending`` (peaks: the maximum over runs), ``whatif`` {verdict, reason}); ``factor_effects`` (``factor``, ``metric``,
``effect``, ``noise``, ``low``, ``high``, ``real``); ``verdict`` (the conclusion, one paragraph) and
``verdict_details`` (one sentence per metric). Noise is the run-to-run sample standard deviation for a
cell and the 95% half-width for an effect (``otel_kvtrace.experiment.analysis``). One aggregation rule:
every percentile and mean is computed per run, then averaged over the cell's runs; a wait stage that did
not happen for a task counts 0 ms. ``measured_policies``: when the scheduler factor varies, predicted vs
measured per non-FIFO policy (``kvtrace whatif --measured``) for each group of cells that differ only in it.
"""

from __future__ import annotations

import platform
import statistics
from importlib import metadata
from pathlib import Path
from typing import Any

import orjson

from otel_kvtrace.experiment.analysis import LABELS, METRICS, factor_effects, noise_of, run_metrics, verdict
from otel_kvtrace.experiment.matrix import FACTORS, MatrixError, read_matrix
from otel_kvtrace.experiment.runner import read_status
from otel_kvtrace.load import LoadError


class ReportError(ValueError):
    """The folder is not an experiment (or holds no finished run); the message says which."""


def build_report(folder: Path) -> dict[str, Any]:
    """The report document of an experiment folder (see the module docstring for the keys)."""
    try:
        matrix = read_matrix(folder / "matrix.yaml")
    except MatrixError as exc:
        raise ReportError(f"{folder}: not an experiment folder ({exc})") from None
    cells = [_cell(folder, c.cell_id, c.config, matrix.runs) for c in matrix.cells]
    if not any(r["status"] == "ok" for c in cells for r in c["runs"]):
        raise ReportError(f"{folder}: no finished run yet (run `kvtrace experiment MATRIX.yaml --out {folder}`)")
    factors = [f for f in FACTORS if any(f in c["config"] for c in cells)]
    inputs = [{"config": c["config"], "run_values": {m: [r[m] for r in c["runs"] if r["status"] == "ok"]
                                                     for m in METRICS}} for c in cells]
    effects = factor_effects(inputs, factors)
    details = [verdict(effects, m) for m in METRICS]
    return {"title": f"Experiment {matrix.name}", "folder": str(folder), "environment": environment(matrix.environment),
            "factors": factors, "cells": cells, "factor_effects": effects, "verdict": _conclusion(cells, effects, details),
            "verdict_details": details, "measured_policies": measured_policies(cells)}


def measured_policies(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For cells that differ only in ``scheduler``: each non-FIFO cell's measured runs against what the
    what-if predicted for that policy from the FIFO cell's runs (``kvtrace whatif --measured``)."""
    groups: dict[str, dict[str, dict[str, Any]]] = {}
    for c in cells:
        if "scheduler" not in c["config"]:
            return []
        rest = orjson.dumps({k: v for k, v in c["config"].items() if k != "scheduler"}, option=orjson.OPT_SORT_KEYS)
        groups.setdefault(rest.decode(), {})[str(c["config"]["scheduler"] or "fifo")] = c
    out = []
    for by_policy in groups.values():
        fifo = by_policy.get("fifo")
        for policy, cell in sorted(by_policy.items()):
            if policy == "fifo" or fifo is None:
                continue
            out.append(_measured_one(fifo, policy, cell))
    return out


def _ok_traces(cell: dict[str, Any]) -> list[str]:
    return [r["traces"] for r in cell["runs"] if r["status"] == "ok"]


def _measured_one(fifo: dict[str, Any], policy: str, cell: dict[str, Any]) -> dict[str, Any]:
    base = {"fifo_cell": fifo["cell_id"], "policy": policy, "policy_cell": cell["cell_id"]}
    fifo_runs, policy_runs = _ok_traces(fifo), _ok_traces(cell)
    if not fifo_runs or not policy_runs:
        return {**base, "error": "no finished run in one of the two cells"}
    from otel_kvtrace.whatif.api import whatif

    try:
        report = whatif(fifo_runs, measured=policy_runs)
        comparisons = [m for v in report.verdicts for m in v.extra.get("measured", ()) if m["policy"] == policy]
    except Exception as exc:  # noqa: BLE001 - one comparison failing must not lose the report
        return {**base, "error": f"comparison failed: {type(exc).__name__}: {exc}"}
    if not comparisons:
        return {**base, "error": "the what-if found no matching configuration"}
    m = comparisons[0]
    return {**base, **{k: m[k] for k in ("predicted_gain_ms", "measured_gain_ms", "noise_ms", "gain_error_pct",
                                         "verdict", "reason")}}


def environment(declared: dict[str, Any]) -> dict[str, Any]:
    """What the matrix declares (hardware, cards, TP/CP/PP/DP) plus what this machine says."""
    versions = {}
    for dist in ("otel-kvtrace", "vllm", "vllm-ascend", "torch", "torch-npu", "opentelemetry-sdk"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return {**declared, "host": platform.node(), "machine": platform.machine(), "cpu": _cpu_model(),
            "python": platform.python_version(), "versions": versions}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _cell(folder: Path, cell_id: str, config: dict[str, Any], runs: int) -> dict[str, Any]:
    cdir = folder / "cells" / cell_id
    meta = orjson.loads((cdir / "cell.json").read_bytes()) if (cdir / "cell.json").exists() else {}
    run_docs = []
    for k in range(1, runs + 1):
        rdir = cdir / f"run-{k}"
        status = read_status(rdir) or {"status": "not run"}
        doc: dict[str, Any] = {"run": k, "status": status.get("status"), "reason": status.get("reason", ""),
                               "log_tail": status.get("log_tail", ""), "command": status.get("command", ""),
                               "traces": str(rdir / "data" / "traces")}
        if doc["status"] == "ok":
            try:
                doc.update(run_metrics(rdir))
            except (LoadError, OSError, ValueError, KeyError) as exc:  # a damaged run is reported, not fatal
                doc.update(status="unreadable", reason=f"{type(exc).__name__}: {exc}")
        run_docs.append(doc)
    ok = [r for r in run_docs if r["status"] == "ok"]
    pct = [_avg([r[f"ttft_{q}_ms"] for r in ok]) for q in ("p50", "p95", "p99")]
    cell = {"cell_id": cell_id, "config": _plain(config), "command": meta.get("command", ""),
            "kv_transfer_config": meta.get("kv_transfer_config", ""), "runs": run_docs, "runs_ok": len(ok),
            "ttft_ms": dict(zip(("p50", "p95", "p99"), pct, strict=True)),
            "ttft_p50_noise_ms": noise_of([r["ttft_p50_ms"] for r in ok]),
            "throughput_tok_s": _avg([r["throughput_tok_s"] for r in ok]),
            "throughput_noise_tok_s": noise_of([r["throughput_tok_s"] for r in ok]),
            "hol": {"events": _avg([r["hol_events"] for r in ok]), "total_ms": _avg([r["hol_total_ms"] for r in ok]),
                    "total_ms_noise": noise_of([r["hol_total_ms"] for r in ok])},
            "wait_percentiles": _mean_percentiles([r["wait_percentiles"] for r in ok]),
            "queue_wait_ms": _avg([r["queue_wait_ms"] for r in ok]),
            "consumer_wait_ms": _avg([r["consumer_wait_ms"] for r in ok]),
            "peak_host_rss_mb": _max([r["peak_host_rss_mb"] for r in ok]),
            "peak_npu_allocated_mb": _max([r.get("peak_npu_allocated_mb") for r in ok]),
            "peak_inflight_tasks": _max([r["peak_inflight_tasks"] for r in ok]),
            "peak_outstanding_leases": _max([r.get("peak_outstanding_leases") for r in ok]),
            "peak_backend_copies_pending": _max([r.get("peak_backend_copies_pending") for r in ok]),
            "stage_ms": _mean_stages([r.get("stage_ms") or {} for r in ok]),
            "whatif": _whatif([Path(r["traces"]) for r in ok])}
    return cell


def _mean_percentiles(per_run: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, float | None]]:
    """Per wait kind, each percentile averaged over the runs (``queue_wait_ms``, ``dep_wait_ms``, ``hol_event_ms``)."""
    kinds = ("queue_wait_ms", "dep_wait_ms", "hol_event_ms")
    return {k: {q: _avg([r[k][q] for r in per_run]) for q in ("p50", "p95", "p99")} for k in kinds}


def _mean_stages(per_run: list[dict[str, float]]) -> dict[str, float]:
    """Mean ms per task of each stage, averaged over the runs (the stages every run has)."""
    common = set.intersection(*(set(r) for r in per_run)) if per_run else set()
    return {st: statistics.fmean(r[st] for r in per_run) for st in per_run[0] if st in common} if common else {}


def stage_explanation(cell: dict[str, Any]) -> str:
    """Which stages the cell's recv tasks spent their time in, largest first (from its own traces)."""
    stages = sorted(((ms, st) for st, ms in (cell.get("stage_ms") or {}).items() if ms > 0), reverse=True)
    total = sum(ms for ms, _ in stages)
    if not total:
        return "no recv task time recorded"
    top = ", ".join(f"{st} {ms:.3g} ms ({100 * ms / total:.0f}%)" for ms, st in stages[:3])
    return f"per recv task: {top} of {total:.3g} ms in stages"


def _plain(config: dict[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()}


def _avg(values: list[Any]) -> float | None:
    clean = [v for v in values if v is not None]
    return statistics.fmean(clean) if clean else None


def _max(values: list[Any]) -> Any:
    clean = [v for v in values if v is not None]
    return max(clean) if clean else None


def _whatif(trace_dirs: list[Path]) -> dict[str, Any]:
    """FIFO vs the candidate policies, replayed on the cell's runs (``kvtrace whatif``)."""
    if not trace_dirs:
        return {"verdict": "", "reason": "no finished run"}
    from otel_kvtrace.whatif.api import whatif

    try:
        report = whatif([str(d) for d in trace_dirs])
    except Exception as exc:  # noqa: BLE001 - one cell's replay failing must not lose the report
        return {"verdict": "", "reason": f"replay failed: {type(exc).__name__}: {exc}"}
    if not report.verdicts:
        return {"verdict": "", "reason": "no recv tasks to replay"}
    v = report.verdicts[0]
    return {"verdict": v.verdict, "reason": v.reason}


def _conclusion(cells: list[dict[str, Any]], effects: list[dict[str, Any]], details: list[str]) -> str:
    switch = [c["cell_id"] for c in cells if c["whatif"]["verdict"] and not c["whatif"]["verdict"].startswith("keep")]
    hol = details[0]
    policy = (f"replay says switch in {len(switch)} of {len(cells)} cells ({', '.join(switch)})" if switch
              else "replay says keep FIFO in every cell")
    failed = sum(r["status"] != "ok" for c in cells for r in c["runs"])
    tail = f" {failed} run(s) failed or did not run (see the cells)." if failed else ""
    ttft = details[3][:1].upper() + details[3][1:]
    return f"{hol}. {ttft}. FIFO vs candidates: {policy}.{tail}"


def write_reports(folder: Path) -> list[Path]:
    """Write ``report.json``, ``report.md`` and ``report.html`` into ``folder``."""
    from otel_kvtrace.experiment.render import render_html, render_markdown

    doc = build_report(folder)
    paths = [folder / "report.json", folder / "report.md", folder / "report.html"]
    paths[0].write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
    paths[1].write_text(render_markdown(doc))
    paths[2].write_text(render_html(doc))
    return paths


__all__ = ["LABELS", "ReportError", "build_report", "write_reports"]
