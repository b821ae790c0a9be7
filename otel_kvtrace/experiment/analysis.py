"""Per-run metrics of an experiment folder and the factor analysis over its cells.

Per run (from its own files): TTFT percentiles and output throughput (``load.json``), HOL events and total
(``queries/hol_summary.sql`` over the run's traces), mean queue wait and consumer wait per recv task
and wait percentiles (``queries/task_waits.sql``), peak host RSS and peak tasks in flight (the resource series).

Factor analysis (``factor_effects``), for a balanced grid: a factor's **main effect** on a metric is the
mean of the per-run values at its highest level minus the mean at its lowest level (other factors
averaged over); the **interaction** of two factors is ``(m_hh - m_hl - m_lh + m_ll) / 2`` over the four
corner means. Each comes with its **noise**: the half-width of the 95% confidence interval from the
pooled within-cell (run-to-run) variance ``s^2`` with ``df = sum(runs - 1)`` degrees of freedom,
``t(df) * s * sqrt(1/n_high + 1/n_low)`` for a main effect and ``t(df) * s/2 * sqrt(sum(1/n_corner))`` for an
interaction (``t`` the two-sided 97.5% Student quantile). An effect is *real* when ``|effect| > noise``;
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

METRICS = ("hol_total_ms", "queue_wait_ms", "consumer_wait_ms", "ttft_p50_ms")
"""Metrics the factor analysis explains (per run): HOL total, mean queue / consumer wait per task, TTFT p50."""
LABELS = {"hol_total_ms": "HOL time (ms per run)", "queue_wait_ms": "queue wait (ms per task)",
          "consumer_wait_ms": "consumer wait (ms per task)", "ttft_p50_ms": "TTFT p50 (ms)"}


def run_metrics(rdir: Path) -> dict[str, Any]:
    """The metrics of one finished run folder (``load.json`` + ``data/``)."""
    from otel_kvtrace.analyse import run_query
    from otel_kvtrace.load import load_traces
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
        "ttft_values_ms": [_ttft(r) for r in load["requests"] if _ttft(r) is not None],
        "throughput_tok_s": s["output_throughput_tok_s"],
        "hol_events": int(sum(r["hol_events"] or 0 for r in hol)),
        "hol_total_ms": float(sum(r["hol_total_ms"] or 0.0 for r in hol)),
        "dep_wait_ms": float(sum(r["dep_wait_ms"] or 0.0 for r in hol)),
        "wait_percentiles": waits_pct,
        "queue_wait_ms": float(waits["queue_wait_ms"] or 0.0), "consumer_wait_ms": float(waits["consumer_wait_ms"] or 0.0),
        "tasks": int(waits["tasks"]),
        "peak_host_rss_mb": res.get("host_rss_bytes", {}).get("peak", 0) / 2**20 if res.get("host_rss_bytes") else None,
        "peak_inflight_tasks": res.get("tasks_in_flight", {}).get("peak"),
        "peak_outstanding_leases": res.get("outstanding_leases", {}).get("peak"),
        "peak_backend_copies_pending": res.get("backend_copies_pending", {}).get("peak"),
    }


def _pcts(values: Sequence[float] | None) -> dict[str, float | None]:
    vals = list(values) if values is not None else [None, None, None]
    return {k: (v / 1e6 if v is not None else None) for k, v in zip(("p50", "p95", "p99"), vals, strict=True)}


def _ttft(r: dict[str, Any]) -> float | None:
    if not r.get("first_token_unix_ns") or r.get("error"):
        return None
    return (r["first_token_unix_ns"] - r["start_unix_ns"]) / 1e6


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045,
         2.042)


def t975(df: int) -> float:
    """Two-sided 95% Student t quantile (table to 30 degrees of freedom, then the normal 1.96)."""
    return _T975[df - 1] if 1 <= df <= len(_T975) else 1.96


def pooled_variance(groups: Sequence[Sequence[float]]) -> tuple[float, int] | None:
    """Within-group variance pooled over groups with >= 2 values, and its degrees of freedom."""
    ss = sum(sum((x - _mean(g)) ** 2 for x in g) for g in groups if len(g) >= 2)
    df = sum(len(g) - 1 for g in groups if len(g) >= 2)
    return (ss / df, df) if df > 0 else None


def factor_effects(cells: Sequence[dict[str, Any]], factors: Sequence[str],
                   metrics: Sequence[str] = METRICS,
                   pairs: Sequence[tuple[str, str]] | None = None) -> list[dict[str, Any]]:
    """Main effects of every factor with >= 2 levels and the interaction of every pair of them (or of
    ``pairs`` only). Levels sort by value with ``None`` (the upstream default) last.

    ``cells``: ``[{"config": {factor: level}, "run_values": {metric: [per-run values]}}]``.
    """
    varying = [f for f in factors if len({_key(c["config"].get(f)) for c in cells}) >= 2]
    out: list[dict[str, Any]] = []
    for metric in metrics:
        groups = [c["run_values"].get(metric) or [] for c in cells]
        var = pooled_variance(groups)
        for f in varying:
            out.append(_main(cells, f, metric, var))
        for a, b in itertools.combinations(varying, 2):
            if pairs is None or (a, b) in pairs or (b, a) in pairs:
                out.append(_interaction(cells, a, b, metric, var))
    return out


def _key(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _levels(cells: Sequence[dict[str, Any]], f: str) -> tuple[Any, Any]:
    levels = sorted({_key(c["config"].get(f)) for c in cells}, key=lambda v: (v is None, str(type(v)), v))
    return levels[0], levels[-1]


def _values_at(cells: Sequence[dict[str, Any]], metric: str, **where: Any) -> list[float]:
    return [v for c in cells if all(_key(c["config"].get(k)) == lv for k, lv in where.items())
            for v in (c["run_values"].get(metric) or []) if v is not None]


def _main(cells: Sequence[dict[str, Any]], f: str, metric: str, var: tuple[float, int] | None) -> dict[str, Any]:
    low, high = _levels(cells, f)
    lo, hi = _values_at(cells, metric, **{f: low}), _values_at(cells, metric, **{f: high})
    effect = _mean(hi) - _mean(lo) if lo and hi else None
    noise = None
    if var is not None and lo and hi:
        noise = t975(var[1]) * math.sqrt(var[0] * (1 / len(hi) + 1 / len(lo)))
    return _effect(f, metric, effect, noise, low, high)


def _interaction(cells: Sequence[dict[str, Any]], a: str, b: str, metric: str, var: tuple[float, int] | None) -> dict[str, Any]:
    (al, ah), (bl, bh) = _levels(cells, a), _levels(cells, b)
    corners = [_values_at(cells, metric, **{a: x, b: y}) for x, y in ((ah, bh), (ah, bl), (al, bh), (al, bl))]
    if not all(corners):
        return _effect(f"{a}:{b}", metric, None, None, None, None)
    hh, hl, lh, ll = (_mean(c) for c in corners)
    effect = (hh - hl - lh + ll) / 2
    noise = t975(var[1]) * math.sqrt(var[0] * sum(1 / len(c) for c in corners)) / 2 if var is not None else None
    return _effect(f"{a}:{b}", metric, effect, noise, None, None)


def _effect(factor: str, metric: str, effect: float | None, noise: float | None, low: Any, high: Any) -> dict[str, Any]:
    real = effect is not None and noise is not None and abs(effect) > noise
    return {"factor": factor, "metric": metric, "effect": effect, "noise": noise, "low": _json(low),
            "high": _json(high), "real": real}


def _json(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def verdict(effects: Sequence[dict[str, Any]], metric: str = "hol_total_ms") -> str:
    """One sentence on what drives ``metric``: the real effects, largest first, and what is within noise."""
    rows = [e for e in effects if e["metric"] == metric and e["effect"] is not None]
    if not rows:
        return f"no factor varies or no run finished: nothing to say about {LABELS.get(metric, metric)}"
    if all(e["noise"] is None for e in rows):
        return f"only one run per cell: no noise estimate, so no effect on {LABELS.get(metric, metric)} can be claimed"
    real = sorted((e for e in rows if e["real"]), key=lambda e: -abs(e["effect"]))
    flat = [e["factor"] for e in rows if not e["real"]]
    label = LABELS.get(metric, metric)
    if not real:
        return f"no factor changes {label} beyond run-to-run noise ({', '.join(flat)} within noise)"
    said = "; ".join(f"{e['factor']} {_dir(e)} it by {abs(e['effect']):.3g} (noise {e['noise']:.2g})" for e in real)
    tail = f"; within noise: {', '.join(flat)}" if flat else ""
    return f"{label}: {said}{tail}"


def _dir(e: dict[str, Any]) -> str:
    if ":" in e["factor"]:
        return "(interaction) shifts"
    return f"({e['low']} -> {e['high']}) {'raises' if e['effect'] > 0 else 'lowers'}"


def noise_of(values: Sequence[float]) -> float | None:
    """Run-to-run noise of one cell: the sample standard deviation (``None`` below 2 runs)."""
    clean = [v for v in values if v is not None]
    return statistics.stdev(clean) if len(clean) >= 2 else None
