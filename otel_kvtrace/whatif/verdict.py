"""The decision per configuration: keep FIFO, or switch, from >= 3 independent runs.

Rules (design §5), checked in this order:
1. FIFO replay must reproduce the recorded completions in every run: each run's median |error| <= 5%
   of its median service time (pooling would let accurate runs hide a bad one); the pooled median and
   p95 are reported too. Otherwise "keep FIFO" naming the worst run, no policy compared.
2. At least ``MIN_REPEATS`` independent runs.
3. HOL must be stable: at least one HOL event in every run. Otherwise "no stable HOL".
4. Per policy, the gain is the paired per-run reduction of the mean TTFT estimate (FIFO minus policy,
   same recorded input). Its lower bound is the minimum over runs; the noise is the run-to-run standard
   deviation of FIFO's mean TTFT. A policy qualifies when lower bound > 0 and lower bound > noise.
5. A qualifying policy must not regress the tail (p99 TTFT, any run, beyond ``P99_TOLERANCE`` = 1% of
   FIFO's: a p99 over a few steps moves by that much with the order alone) or the peak in-flight task
   count (any run, no tolerance). The reasons state the tolerance.
The best qualifying policy (largest lower bound) wins; otherwise "keep FIFO" with the reason.

Independent pairs (``decide(..., independent=True)``: measured runs, the FIFO run of seed k against the
policy run of seed k recorded separately, ``kvtrace whatif --measured``). On replays a run's gain is the gain on that run's
input, so the minimum over runs is the worst input and "any run regresses" is a fact about an input.
A measured pair's difference also holds two runs' own noise (it is a sample, not the gain on an input):
its minimum over n pairs is about ``mean - 1.4 sd`` at 8 pairs, falls with every pair added, and "any
pair's p99 is 1% worse" becomes certain as pairs are added even when the policy's p99 is better. So for
independent pairs the same rules ask the statistical question instead: the lower bound is the one-sided
95% confidence bound of the mean paired gain (``mean - t95(n-1) * sd / sqrt(n)``), and a regression is one
that the same bound does not exclude (upper 95% bound of the mean paired change of p99 TTFT above
``P99_TOLERANCE`` of FIFO's, of peak in-flight above 0). Thresholds, noise and tolerance are unchanged.

Pairing a measured FIFO run with a measured policy run only means something when both ran the same input
(the same seed): :mod:`.measured` pairs by seed label and otherwise passes the two sets of runs apart
(``decide(fifo_runs, policy_runs={name: runs})``): the bounds are then Welch's two-sample bounds (difference
of the means, standard error ``sqrt(sA^2/nA + sB^2/nB)``, Welch-Satterthwaite degrees of freedom), over
every run of both sets, so renaming runs or unequal counts change nothing. ``gains[name]["bound"]`` says
which bound was used (``WORST``, ``PAIRED``, ``WELCH``), and so does the reason. Each policy is tested at
95% on its own and the best qualifying one wins: no correction for the number of policies compared.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from otel_kvtrace.student_t import t95
from otel_kvtrace.whatif.metrics import validation_from
from otel_kvtrace.whatif.replay import RunSummary

MIN_REPEATS = 3
MAX_FIFO_ERROR_PCT = 5.0
P99_TOLERANCE = 0.01
"""A policy's p99 TTFT may exceed FIFO's by at most this fraction (in every run); stated in every reason."""
KEEP = "keep FIFO"
WORST = "worst run"
"""``gains[...]["bound"]``: the minimum over runs (replays: each run is one input replayed twice)."""
PAIRED = "95% confidence bound, paired"
"""Independent pairs of the same input (measured FIFO and policy run of one seed): bound of the mean paired gain."""
WELCH = "95% confidence bound, Welch two-sample"
"""Unpaired measured runs: Welch's bound of the difference of the two sets' means."""
METRICS = ("ttft_ms_mean", "ttft_ms_p99", "consumer_wait_ms_per_step", "consumer_wait_ms_p99_layer",
           "peak_inflight", "throughput_tasks_per_s")


def spread(values: list[float]) -> dict[str, Any]:
    """mean/min/max/stdev and the per-run values."""
    return {
        "mean": statistics.fmean(values) if values else 0.0,
        "min": min(values, default=0.0),
        "max": max(values, default=0.0),
        "stdev": statistics.stdev(values) if len(values) >= 2 else 0.0,
        "per_run": values,
    }


@dataclass(slots=True)
class ConfigVerdict:
    """Verdict and evidence for one configuration (all its runs)."""

    cfg_label: str
    config: dict[str, Any]
    run_ids: list[str]
    fifo_median_error_pct: float
    fifo_p95_error_pct: float
    validated: bool
    hol_events: list[int]
    hol_ms: list[float]
    policies: dict[str, dict[str, dict[str, Any]]]
    gains: dict[str, dict[str, Any]]
    noise_ms: float
    verdict: str
    reason: str
    reproduce: str = ""
    fifo_worst_run: str = ""
    """The run with the largest FIFO median error (each run must be <= 5% on its own)."""
    fifo_worst_run_error_pct: float = 0.0
    layers: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    """policy -> per-layer means over runs: ``layer``, ``load_done_ms`` (after the step's first
    enqueue), ``consumer_wait_ms``."""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}  # type: ignore[attr-defined]


def confidence_bounds(values: list[float]) -> tuple[float, float]:
    """One-sided 95% lower and upper confidence bounds of the mean of independent ``values`` (-inf, inf
    for fewer than two values: no bound; the reasons then say so, never print it)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return float("-inf"), float("inf")
    half = t95(len(values) - 1) * statistics.stdev(values) / len(values) ** 0.5
    return mean - half, mean + half


def welch_bounds(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """One-sided 95% lower and upper confidence bounds of ``mean(a) - mean(b)`` for two independent
    samples (Welch: standard error ``sqrt(var(a)/na + var(b)/nb)``, Welch-Satterthwaite degrees of
    freedom, returned third). (-inf, inf, 0) when either sample has fewer than two values."""
    diff = statistics.fmean(a) - statistics.fmean(b)
    if len(a) < 2 or len(b) < 2:
        return float("-inf"), float("inf"), 0.0
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    se2 = va + vb
    if se2 <= 0:
        return diff, diff, float("inf")
    df = se2 ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    half = t95(df) * se2 ** 0.5
    return diff - half, diff + half, df


def decide(runs: list[RunSummary], *, cfg_label: str = "", config: dict[str, Any] | None = None,
           reproduce: str = "", independent: bool = False,
           policy_runs: dict[str, list[RunSummary]] | None = None) -> ConfigVerdict:
    """Apply the verdict rules to the runs of one configuration. ``independent``: each run is a pair of
    separately recorded runs of the same input (measured A/B, paired by seed): lower bound and regressions
    are 95% confidence bounds of the mean over the pairs (module docstring). ``policy_runs``: unpaired
    measured runs, per policy, compared with the FIFO runs ``runs`` (figures ``fifo``) by Welch's
    two-sample bounds; every run of both sets counts, whatever their number."""
    if not runs:
        raise ValueError("runs: need at least one run")
    rule = WELCH if policy_runs else PAIRED if independent else WORST
    by_name: dict[str, list[RunSummary]] = (
        {"fifo": runs, **policy_runs} if policy_runs else {name: runs for name in runs[0].figures})
    names = list(by_name)
    pooled = validation_from([e for r in runs for e in r.fifo_errors_ns], [s for r in runs for s in r.service_ns])
    med, p95 = pooled.median_error_pct, pooled.p95_error_pct
    checks = [r.validation for r in runs]
    worst_at = max(range(len(runs)), key=lambda k: checks[k].median_error_pct)
    worst, worst_id = checks[worst_at].median_error_pct, runs[worst_at].run_id
    validated = pooled.ok and all(v.ok for v in checks)
    policies = {
        name: {m: spread([float(r.figures[name][m]) for r in by_name[name]]) for m in METRICS} for name in names
    }
    fifo_ttft = [r.figures["fifo"]["ttft_ms_mean"] for r in runs]
    noise = statistics.stdev(fifo_ttft) if len(fifo_ttft) >= 2 else 0.0
    gains: dict[str, dict[str, Any]] = {}
    for name in names:
        if name == "fifo":
            continue
        gains[name] = (_welch_gain(runs, by_name[name], name) if rule == WELCH
                       else _paired_gain(runs, name, independent=rule == PAIRED))
        lower = gains[name]["lower_bound_ms"]
        gains[name]["above_noise"] = lower > 0 and lower > noise
    hol_events = [r.hol_events for r in runs]
    layers = _mean_layers(by_name)
    hol_ms = [r.hol_ms for r in runs]
    counts = {name: len(v) for name, v in by_name.items()}
    verdict, reason = _rule(runs, validated, med, (worst_id, worst), hol_events, gains, noise, rule, counts)
    return ConfigVerdict(
        cfg_label=cfg_label or runs[0].cfg_label, config=config or {}, run_ids=[r.run_id for r in runs],
        fifo_median_error_pct=round(med, 3), fifo_p95_error_pct=round(p95, 3), validated=validated,
        hol_events=hol_events, hol_ms=hol_ms, policies=policies if validated else {"fifo": policies["fifo"]},
        gains=gains if validated else {}, noise_ms=noise, verdict=verdict, reason=reason, reproduce=reproduce,
        fifo_worst_run=worst_id, fifo_worst_run_error_pct=round(worst, 3),
        layers=layers if validated else {k: v for k, v in layers.items() if k == "fifo"},
        extra={"policy_runs": {n: [r.run_id for r in v] for n, v in policy_runs.items()}} if policy_runs else {},
    )


def _paired_gain(runs: list[RunSummary], name: str, *, independent: bool) -> dict[str, Any]:
    """Gain evidence from per-run differences (one input replayed, or a measured pair of one seed)."""
    per_run = [r.figures["fifo"]["ttft_ms_mean"] - r.figures[name]["ttft_ms_mean"] for r in runs]
    p99_over = [r.figures[name]["ttft_ms_p99"] - r.figures["fifo"]["ttft_ms_p99"] * (1 + P99_TOLERANCE)
                for r in runs]
    inflight_over = [float(r.figures[name]["peak_inflight"] - r.figures["fifo"]["peak_inflight"]) for r in runs]
    if independent:
        lower = confidence_bounds(per_run)[0]
        p99_regress = confidence_bounds(p99_over)[1] > 1e-9
        inflight_regress = confidence_bounds(inflight_over)[1] > 0
    else:
        lower = min(per_run)
        p99_regress = any(d > 1e-9 for d in p99_over)
        inflight_regress = any(d > 0 for d in inflight_over)
    return {"ttft_gain_ms": spread(per_run), "lower_bound_ms": lower, "p99_regression": p99_regress,
            "inflight_regression": inflight_regress, "bound": PAIRED if independent else WORST}


def _welch_gain(fifo: list[RunSummary], policy: list[RunSummary], name: str) -> dict[str, Any]:
    """Gain evidence from two unpaired sets of runs: Welch bounds of the differences of the means
    (``ttft_gain_ms`` has no per-run gains: ``per_run`` is empty, both sets' values are given)."""
    f_ttft = [float(r.figures["fifo"]["ttft_ms_mean"]) for r in fifo]
    p_ttft = [float(r.figures[name]["ttft_ms_mean"]) for r in policy]
    lower, _, df = welch_bounds(f_ttft, p_ttft)
    p99_up = welch_bounds([float(r.figures[name]["ttft_ms_p99"]) for r in policy],
                          [float(r.figures["fifo"]["ttft_ms_p99"]) * (1 + P99_TOLERANCE) for r in fifo])[1]
    inflight_up = welch_bounds([float(r.figures[name]["peak_inflight"]) for r in policy],
                               [float(r.figures["fifo"]["peak_inflight"]) for r in fifo])[1]
    gain = statistics.fmean(f_ttft) - statistics.fmean(p_ttft)
    return {"ttft_gain_ms": {"mean": gain, "df": df, "per_run": [], "fifo_per_run": f_ttft,
                             "policy_per_run": p_ttft},
            "lower_bound_ms": lower, "p99_regression": p99_up > 1e-9, "inflight_regression": inflight_up > 0,
            "bound": WELCH}


def _mean_layers(by_name: dict[str, list[RunSummary]]) -> dict[str, dict[str, list[float]]]:
    """Per policy, the per-layer profile averaged over its runs (layers present in every run)."""
    out: dict[str, dict[str, list[float]]] = {}
    for name, runs in by_name.items():
        profiles = [r.layers[name] for r in runs if r.layers and r.layers.get(name, {}).get("layer")]
        if not profiles:
            continue
        common = sorted(set.intersection(*(set(p["layer"]) for p in profiles)))
        merged: dict[str, list[float]] = {"layer": common}
        for key in ("load_done_ms", "consumer_wait_ms"):
            merged[key] = [
                sum(p[key][p["layer"].index(x)] for p in profiles) / len(profiles) for x in common]
        out[name] = merged
    return out


def _rule(runs: list[RunSummary], validated: bool, med: float, worst: tuple[str, float], hol_events: list[int],
          gains: dict[str, dict[str, Any]], noise: float, rule: str = WORST,
          counts: dict[str, int] | None = None) -> tuple[str, str]:
    counts = counts or {}
    others = {n: c for n, c in counts.items() if n != "fifo"}
    if rule == WELCH:
        sets = " and ".join([f"{len(runs)} FIFO"] + [f"{c} {n}" for n, c in others.items()]) + " runs"
        bound = "Welch 95% lower confidence bound of the mean gain"
        where = f"over {sets} (unpaired)"
        any_run = "(Welch 95% upper confidence bound of the mean change)"
    elif rule == PAIRED:
        bound = "95% lower confidence bound of the mean paired gain"
        where = f"over {len(runs)} independent run pairs"
        any_run = "(95% upper confidence bound of the mean paired change)"
    else:
        bound, where, any_run = "gain lower bound", f"over {len(runs)} runs", "in any run"
    if not validated:
        worst_id, worst_pct = worst
        return KEEP, (f"FIFO replay does not reproduce the recorded completions (worst: run {worst_id}, median "
                      f"error {worst_pct:.1f}% > {MAX_FIFO_ERROR_PCT:.0f}% of service time; pooled over "
                      f"{len(runs)} run(s) {med:.1f}%); no policy compared")
    fewest = min([len(runs), *others.values()])
    if rule == PAIRED and len(runs) == 1:
        return KEEP, f"one measured pair: no confidence bound (need >= {MIN_REPEATS} pairs)"
    if rule == WELCH and fewest == 1:
        return KEEP, f"one measured run in a set ({sets}): no confidence bound (need >= {MIN_REPEATS} of each)"
    if fewest < MIN_REPEATS:
        if rule == WELCH:
            return KEEP, f"only {sets}; need >= {MIN_REPEATS} of each to separate gain from noise"
        return KEEP, f"only {len(runs)} independent run(s); need >= {MIN_REPEATS} to separate gain from noise"
    with_hol = sum(1 for n in hol_events if n > 0)
    if with_hol < len(runs):
        return KEEP, f"no stable HOL (HOL in {with_hol} of {len(runs)} runs)"
    if not gains:
        return KEEP, "no alternative policy replayed"
    qualifying = {n: g for n, g in gains.items() if g["above_noise"]}
    if not qualifying:
        best = max(gains, key=lambda n: gains[n]["lower_bound_ms"])
        lb = gains[best]["lower_bound_ms"]
        return KEEP, (f"HOL present but gain below noise (best: {best}, {bound} {lb:.3f} ms, "
                      f"noise {noise:.3f} ms)")
    clean = {n: g for n, g in qualifying.items() if not g["p99_regression"] and not g["inflight_regression"]}
    if not clean:
        name = max(qualifying, key=lambda n: qualifying[n]["lower_bound_ms"])
        what = [w for w, hit in ((f"p99 TTFT regression (> {_pct(P99_TOLERANCE)})",
                                  qualifying[name]["p99_regression"]),
                                 ("peak in-flight regression", qualifying[name]["inflight_regression"])) if hit]
        return KEEP, (f"gain above noise for {name} but {' and '.join(what)}"
                      + (f" {any_run}" if rule != WORST else ""))
    best = max(clean, key=lambda n: clean[n]["lower_bound_ms"])
    lb = clean[best]["lower_bound_ms"]
    return f"switch to {best}", (f"TTFT {bound} {lb:.3f} ms {where} > noise "
                                 f"{noise:.3f} ms; no p99 TTFT regression beyond {_pct(P99_TOLERANCE)} "
                                 f"and no peak in-flight increase {any_run}")


def _pct(fraction: float) -> str:
    return f"{100 * fraction:g}%"
