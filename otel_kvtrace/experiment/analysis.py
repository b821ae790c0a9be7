"""Per-run metrics of an experiment folder and the factor analysis over its cells.

Per run (from its own files): TTFT percentiles and output throughput (``load.json``), HOL events and total
(``queries/hol_summary.sql`` over the run's traces), mean queue wait and consumer wait per recv task
and wait percentiles (``queries/task_waits.sql``), peak tasks in flight (exact, from the traces: the most
recv tasks of one queue between enqueue and completion at once) and peak host RSS (the resource series).

Factor analysis (``factor_effects``) works inside **complete sub-grids** only (cells that agree on every
other factor), so a grid with collapsed axes or failed cells cannot mix one factor's effect into another's:
a factor's **main effect** of level ``h`` against the base (lowest) level ``l`` is the mean over the K
sub-grids holding both of ``mean(h) - mean(l)``; every non-base level gets its own row. The **interaction**
of two factors is the mean over the sub-grids holding all four extreme corners of
``(m_hh - m_hl - m_lh + m_ll) / 2``. Each comes with its **noise**: the half-width of the 95% confidence
interval from the pooled within-cell (run-to-run) variance ``s^2`` with ``df = sum(runs - 1)``,
``t(df) * s / K * sqrt(sum_k (1/n_hk + 1/n_lk))`` for a main effect (``t(df) * s * sqrt(1/n_h + 1/n_l)`` on
a balanced grid) and ``t(df) * s / (2K) * sqrt(sum of 1/n over the corners)`` for an interaction (``t`` the
two-sided 97.5% Student quantile). A comparison possible in only some sub-grids is flagged unbalanced. An effect is *real* when ``|effect| > noise``;
so an effect that is really zero is called real about 5% of the time.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from otel_kvtrace.student_t import t975

METRICS = ("hol_total_ms", "queue_wait_ms", "consumer_wait_ms", "ttft_p50_ms")
"""Metrics the factor analysis explains (per run): HOL total, mean queue / consumer wait per task, TTFT p50."""
LABELS = {"hol_total_ms": "HOL time (ms per run)", "queue_wait_ms": "queue wait (ms per task)",
          "consumer_wait_ms": "consumer wait (ms per task)", "ttft_p50_ms": "TTFT p50 (ms)"}


def run_metrics(rdir: Path) -> dict[str, Any]:
    """The metrics of one finished run folder (``load.json`` + ``data/``).

    One rule for the waits: a stage that did not happen for a task counts 0 ms, in the means and in the
    percentiles alike (``coalesce(stage_ns, 0)``), over every recv task of the run."""
    from otel_kvtrace.analyse import run_query
    from otel_kvtrace.load import STAGES, load_traces
    from otel_kvtrace.resources import load_resources, resource_summary

    load = orjson.loads((rdir / "load.json").read_bytes())
    s = load["summary"]
    con = load_traces(rdir / "data" / "traces").con
    hol = run_query(con, "hol_summary").records()
    waits = run_query(con, "task_waits").records()[0]
    res = resource_summary(load_resources([rdir / "data"]))
    ttft = s["ttft_ms"]
    first = hol[0] if hol else {}
    waits_pct = {"queue_wait_ms": _pcts(waits["queue_wait_ns"]), "dep_wait_ms": _pcts(waits["dep_wait_ns"]),
                 "hol_event_ms": {k: first.get(f"{k}_ms") for k in ("p50", "p95", "p99")}}
    return {
        "ttft_p50_ms": ttft["p50"], "ttft_p95_ms": ttft["p95"], "ttft_p99_ms": ttft["p99"],
        "throughput_tok_s": s["output_throughput_tok_s"],
        "hol_events": int(sum(r["hol_events"] or 0 for r in hol)),
        "hol_total_ms": float(sum(r["hol_total_ms"] or 0.0 for r in hol)),
        "dep_wait_ms": float(sum(r["dep_wait_ms"] or 0.0 for r in hol)),
        "wait_percentiles": waits_pct,
        "stage_ms": _stage_means(con, STAGES),
        "queue_wait_ms": float(waits["queue_wait_ms"] or 0.0), "consumer_wait_ms": float(waits["consumer_wait_ms"] or 0.0),
        "tasks": int(waits["tasks"]),
        "peak_host_rss_mb": _peak(res, "host_rss_bytes", 2**20),
        "peak_npu_allocated_mb": _peak(res, "npu_max_allocated_bytes", 2**20),
        "peak_inflight_tasks": _peak_inflight(con),
        "peak_outstanding_leases": _peak(res, "outstanding_leases"),
        "peak_backend_copies_pending": _peak(res, "backend_copies_pending"),
    }


def _peak(res: dict[str, Any], field: str, scale: float = 1) -> float | int | None:
    peak = res.get(field, {}).get("peak")
    return None if peak is None else (peak / scale if scale != 1 else peak)


def _peak_inflight(con: Any) -> int:
    """The most recv tasks of one queue enqueued and not completed at once: ``queries/queue_depth_summary.sql``
    over every task's own timestamps (the sampled ``tasks_in_flight`` series can miss a short peak between
    two samples; a task without a completion stays in flight)."""
    from otel_kvtrace.analyse import run_query

    return max((int(r["max_inflight"] or 0) for r in run_query(con, "queue_depth_summary").records()), default=0)


def _stage_means(con: Any, stages: Sequence[str]) -> dict[str, float]:
    """Mean ms per recv task of every stage present (a stage that did not happen counts 0)."""
    cols = {r[0] for r in con.execute("SELECT column_name FROM (DESCRIBE tasks)").fetchall()}
    present = [st for st in stages if f"{st}_ns" in cols]
    if not present:
        return {}
    row = con.execute("SELECT " + ", ".join(f"avg(coalesce({st}_ns, 0)) / 1e6" for st in present)
                      + " FROM tasks").fetchone()
    return {st: float(v or 0.0) for st, v in zip(present, row, strict=True)}


def _pcts(values: Sequence[float] | None) -> dict[str, float | None]:
    vals = list(values) if values is not None else [None, None, None]
    return {k: (v / 1e6 if v is not None else None) for k, v in zip(("p50", "p95", "p99"), vals, strict=True)}


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def pooled_variance(groups: Sequence[Sequence[float | None]]) -> tuple[float, int] | None:
    """Within-group variance pooled over groups with >= 2 values (``None`` = no value), and its degrees of freedom."""
    clean = [[x for x in g if x is not None] for g in groups]
    ss = sum(sum((x - _mean(g)) ** 2 for x in g) for g in clean if len(g) >= 2)
    df = sum(len(g) - 1 for g in clean if len(g) >= 2)
    return (ss / df, df) if df > 0 else None


def factor_effects(cells: Sequence[dict[str, Any]], factors: Sequence[str],
                   metrics: Sequence[str] = METRICS,
                   pairs: Sequence[tuple[str, str]] | None = None) -> list[dict[str, Any]]:
    """Main effects of every factor with >= 2 levels and the interaction of every pair of them (or of
    ``pairs`` only), each computed only inside complete sub-grids: cells that agree on every other factor.

    Levels sort by value with ``None`` (the server's default) last; the base is the lowest level and every
    other level gets its own effect row (so a middle level is never dropped). The interaction compares the
    extreme levels. ``contexts`` / ``contexts_total`` say in how many of the sub-grids where the factor
    appears the comparison was possible; ``balanced`` is False when some were not (collapsed or failed cells).

    ``cells``: ``[{"config": {factor: level}, "run_values": {metric: [per-run values]}}]``.
    """
    varying = [f for f in factors if len(_levels(cells, f)) >= 2]
    out: list[dict[str, Any]] = []
    for metric in metrics:
        var = pooled_variance([c["run_values"].get(metric) or [] for c in cells])
        for f in varying:
            levels = _levels(cells, f)
            out += [_main(cells, factors, f, levels[0], high, metric, var) for high in levels[1:]]
        for a, b in itertools.combinations(varying, 2):
            if pairs is None or (a, b) in pairs or (b, a) in pairs:
                out.append(_interaction(cells, factors, a, b, metric, var))
    return out


def _key(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def level_order(value: Any) -> tuple[bool, str, Any]:
    """Sort key of a factor level: by value within a type, ``None`` (the default) last."""
    return (value is None, str(type(value)), value if value is not None else 0)


def _levels(cells: Sequence[dict[str, Any]], f: str) -> list[Any]:
    return sorted({_key(c["config"].get(f)) for c in cells}, key=level_order)


def _subgrids(cells: Sequence[dict[str, Any]], factors: Sequence[str], of: tuple[str, ...],
              metric: str) -> dict[tuple[Any, ...], dict[tuple[Any, ...], list[float]]]:
    """{levels of the other factors: {levels of ``of``: the runs' values}} (a cell without values gives [])."""
    grids: dict[tuple[Any, ...], dict[tuple[Any, ...], list[float]]] = {}
    for c in cells:
        ctx = tuple(_key(c["config"].get(g)) for g in factors if g not in of)
        at = tuple(_key(c["config"].get(g)) for g in of)
        values = [v for v in (c["run_values"].get(metric) or []) if v is not None]
        grids.setdefault(ctx, {}).setdefault(at, []).extend(values)
    return grids


def _main(cells: Sequence[dict[str, Any]], factors: Sequence[str], f: str, low: Any, high: Any, metric: str,
          var: tuple[float, int] | None) -> dict[str, Any]:
    grids = [g for g in _subgrids(cells, factors, (f,), metric).values() if (low,) in g or (high,) in g]
    matched = [(g[(low,)], g[(high,)]) for g in grids if g.get((low,)) and g.get((high,))]
    effect = noise = None
    if matched:
        effect = _mean([_mean(h) - _mean(lo) for lo, h in matched])
        if var is not None:
            spread = sum(1 / len(lo) + 1 / len(h) for lo, h in matched)
            noise = t975(var[1]) * math.sqrt(var[0] * spread) / len(matched)
    return _effect(f, metric, effect, noise, low, high, len(matched), len(grids))


def _interaction(cells: Sequence[dict[str, Any]], factors: Sequence[str], a: str, b: str, metric: str,
                 var: tuple[float, int] | None) -> dict[str, Any]:
    la, lb = _levels(cells, a), _levels(cells, b)
    corners = [(x, y) for x in (la[-1], la[0]) for y in (lb[-1], lb[0])]  # hh, hl, lh, ll
    grids = [g for g in _subgrids(cells, factors, (a, b), metric).values() if any(k in g for k in corners)]
    matched = [[g[k] for k in corners] for g in grids if all(g.get(k) for k in corners)]
    effect = noise = None
    if matched:
        effect = _mean([(_mean(hh) - _mean(hl) - _mean(lh) + _mean(ll)) / 2 for hh, hl, lh, ll in matched])
        if var is not None:
            spread = sum(1 / len(c) for m in matched for c in m)
            noise = t975(var[1]) * math.sqrt(var[0] * spread) / 2 / len(matched)
    return _effect(f"{a}:{b}", metric, effect, noise, None, None, len(matched), len(grids))


def _effect(factor: str, metric: str, effect: float | None, noise: float | None, low: Any, high: Any,
            contexts: int, total: int) -> dict[str, Any]:
    real = effect is not None and noise is not None and abs(effect) > noise
    return {"factor": factor, "metric": metric, "effect": effect, "noise": noise, "low": _json(low),
            "high": _json(high), "real": real, "contexts": contexts, "contexts_total": total,
            "balanced": contexts == total}


def _json(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def verdict(effects: Sequence[dict[str, Any]], metric: str = "hol_total_ms") -> str:
    """One sentence on what drives ``metric``: the real effects, largest first, what is within noise, and
    which comparisons the design could not make or made in only part of its sub-grids."""
    label = LABELS.get(metric, metric)
    mine = [e for e in effects if e["metric"] == metric]
    rows = [e for e in mine if e["effect"] is not None]
    lost = [_name(e) for e in mine if e["effect"] is None]
    gap = f"; not estimable (no complete sub-grid): {', '.join(lost)}" if lost else ""
    if not rows:
        return f"no factor varies or no run finished: nothing to say about {label}{gap}"
    if all(e["noise"] is None for e in rows):
        return f"only one run per cell: no noise estimate, so no effect on {label} can be claimed{gap}"
    real = sorted((e for e in rows if e["real"]), key=lambda e: -abs(e["effect"]))
    flat = [_name(e) for e in rows if not e["real"]]
    part = [f"{_name(e)} in {e['contexts']} of {e['contexts_total']}" for e in rows if not e.get("balanced", True)]
    notes = gap + (f"; unbalanced, compared only in the sub-grids that have both levels: {', '.join(part)}"
                   if part else "")
    if not real:
        return f"no factor changes {label} beyond run-to-run noise ({', '.join(flat)} within noise){notes}"
    said = "; ".join(f"{e['factor']} {_dir(e)} it by {abs(e['effect']):.3g} (noise {e['noise']:.2g})" for e in real)
    return f"{label}: {said}" + (f"; within noise: {', '.join(flat)}" if flat else "") + notes


def _level_text(value: Any) -> str:
    return "default" if value is None else str(value)


def _name(e: dict[str, Any]) -> str:
    if ":" in e["factor"] or e.get("low") is None and e.get("high") is None:
        return e["factor"]
    return f"{e['factor']} ({_level_text(e['low'])} -> {_level_text(e['high'])})"


def _dir(e: dict[str, Any]) -> str:
    if ":" in e["factor"]:
        return "(interaction) shifts"
    return f"({_level_text(e['low'])} -> {_level_text(e['high'])}) {'raises' if e['effect'] > 0 else 'lowers'}"


def noise_of(values: Sequence[float]) -> float | None:
    """Run-to-run noise of one cell: the sample standard deviation (``None`` below 2 runs)."""
    clean = [v for v in values if v is not None]
    return statistics.stdev(clean) if len(clean) >= 2 else None
