"""Predicted vs measured: runs recorded under another recv policy, compared with what the what-if
predicted for that policy from FIFO runs of the same configuration (``kvtrace whatif --measured``).

A measured run's figures come from its own recorded times (dequeue, completion, the forward's recorded
load waits) through the same metric code the replay uses (:func:`queue_figures` on a
:class:`QueueReplay` built from the recording), so predicted and measured numbers mean the same thing.
The measured verdict applies the same rules (:func:`otel_kvtrace.whatif.verdict.decide`); the FIFO runs'
replay check and HOL counts are theirs. The runs are independent recordings, so the lower bound and the
regressions are 95% confidence bounds of the mean, not the worst pair:

- paired (``verdict.PAIRED``) when every run of both sets carries a seed label (:func:`seed_label`: a
  run id ending in ``-s<seed>``, as ``kvtrace demo`` and the fidelity bench write them) and the two sets
  have the same seeds, each once: FIFO run of seed k against the policy run of seed k;
- otherwise unpaired (``verdict.WELCH``, Welch's two-sample bound) over every run of both sets: pairing
  run k with run k in run-id order would make the verdict depend on the runs' names, and would drop runs
  when the counts differ. The reason says why the runs were not paired (and logs a warning when the
  counts differ).

The same measured pairs are also judged by the replays' rule (``verdict_worst``: worst pair,
any pair regresses), so the prediction's verdict and the measurement's can be compared under one rule;
without seed pairs there is no worst pair and that verdict says so.
"""

from __future__ import annotations

import logging
import re
import statistics
from dataclasses import dataclass, field
from typing import Any

from otel_kvtrace.whatif.columns import NONE, QueueArrays
from otel_kvtrace.whatif.engine import QueueReplay
from otel_kvtrace.whatif.metrics import queue_figures, validation_from
from otel_kvtrace.whatif.replay import RunReplay, RunSummary, summarise
from otel_kvtrace.whatif.task import ReplayTask, group_by_queue
from otel_kvtrace.whatif.verdict import METRICS, ConfigVerdict, decide, spread

logger = logging.getLogger(__name__)

MEASURED = "measured"
DISPATCH = "dispatch_ns"
"""Key of the measured figures: median recv-thread dispatch gap of the run's busy, in-order dequeues."""


def busy_dispatch_ns(tasks: list[ReplayTask]) -> int:
    """Median gap from the previous completion to the next dequeue, over dequeues that found the recv
    thread busy (the task was queued before the previous one completed) and went in seq order: the
    thread's own loop and ``get()`` cost, without wake-ups from idle or bypass decisions. 0 if none."""
    gaps: list[int] = []
    for qtasks in group_by_queue(tasks).values():
        done = sorted((t for t in qtasks if t.recorded_start_ns is not None and t.recorded_complete_ns is not None),
                      key=lambda t: t.recorded_start_ns)  # type: ignore[arg-type, return-value]
        for prev, t in zip(done, done[1:]):
            if t.seq > prev.seq and t.arrival_ns < prev.recorded_complete_ns <= t.recorded_start_ns:  # type: ignore[operator]
                gaps.append(t.recorded_start_ns - prev.recorded_complete_ns)  # type: ignore[operator]
    return int(statistics.median(gaps)) if gaps else 0


def dispatch_cost_ns(fifo_measured: list[RunSummary], policy_measured: list[RunSummary]) -> int:
    """The policy's own cost per dequeue, from the measured runs (labelled so wherever it is used):
    median busy dispatch gap of the policy runs minus that of the FIFO runs, never below 0."""
    def med(runs: list[RunSummary]) -> float:
        return statistics.median(float(r.figures[MEASURED].get(DISPATCH, 0)) for r in runs)
    return max(0, int(med(policy_measured) - med(fifo_measured)))


def recorded_replay(q: QueueArrays) -> QueueReplay:
    """The recording itself, shaped like a replay (times rebased to ``q.t0``)."""
    def rb(v: int | None) -> int:
        return NONE if v is None else v - q.t0

    start = [rb(t.recorded_start_ns) for t in q.tasks]
    complete = list(q.rec_complete)
    return QueueReplay(MEASURED, q, start, complete, list(complete), list(q.rs), list(q.rg),
                       [list(a) for a in q.rec_arrive], [list(e) for e in q.rec_end], 0, [])


def measured_summary(tasks: list[ReplayTask], *, run_id: str, cfg_label: str) -> RunSummary:
    """One recorded run's own figures (policy key ``measured``) and per-layer profile."""
    replays: dict[str, dict[str, QueueReplay]] = {}
    figs = []
    for queue, qtasks in group_by_queue(tasks).items():
        rep = recorded_replay(QueueArrays.from_tasks(qtasks))
        replays[queue] = {MEASURED: rep}
        figs.append(queue_figures(rep))
    run = RunReplay(run_id, cfg_label, replays, {MEASURED: summarise(MEASURED, figs)}, validation_from([], []))
    figures = {**run.figures[MEASURED].to_dict(), DISPATCH: busy_dispatch_ns(tasks)}
    return RunSummary(run_id=run_id, cfg_label=cfg_label, figures={MEASURED: figures},
                      fifo_errors_ns=[], service_ns=[], hol_events=0, hol_ms=0.0,
                      layers={MEASURED: run.layer_profile(MEASURED)})


@dataclass(slots=True)
class Comparison:
    """One configuration, one policy: predicted (from FIFO runs) next to measured (policy runs)."""

    cfg_label: str
    policy: str
    fifo_runs: list[str]
    policy_runs: list[str]
    predicted: dict[str, dict[str, Any]]
    measured: dict[str, dict[str, Any]]
    fifo_measured: dict[str, dict[str, Any]]
    predicted_gain_ms: float
    measured_gain_ms: float
    noise_ms: float
    gain_error_pct: float
    """|predicted - measured| mean TTFT gain in % of the measured gain (of the noise when the gain is below it)."""
    dispatch_cost_us: float
    """The policy's own cost per dequeue, taken FROM THE MEASURED RUNS (:func:`dispatch_cost_ns`)."""
    calibrated_gain_ms: float
    """The prediction replayed again with ``dispatch_cost_us`` per dequeue (labelled: uses the measured runs)."""
    calibrated_gain_error_pct: float
    layers: dict[str, dict[str, list[float]]]
    verdict: str
    reason: str
    measured_verdict: dict[str, Any] = field(default_factory=dict)
    predicted_verdict: str = ""
    """The prediction's verdict for this policy alone against FIFO (same rules, the FIFO runs' replays)."""
    predicted_reason: str = ""
    predicted_evidence: dict[str, Any] = field(default_factory=dict)
    """What the predicted verdict rests on: its ``gains[policy]`` (per-run gains, lower bound, p99 and
    in-flight regression flags) and noise, like ``measured_verdict``."""
    pairing: str = ""
    """``seed`` (FIFO and policy run of one seed paired) or ``none`` (Welch over both sets)."""
    pairing_note: str = ""
    """Why the runs were (not) paired, with the run counts; also appended to ``reason``."""
    verdict_worst: str = ""
    """The measured verdict by the replays' rule (worst pair; any pair regresses): comparable with
    ``predicted_verdict``. Only with seed pairs (else ``n/a``)."""
    reason_worst: str = ""
    measured_evidence_worst: dict[str, Any] = field(default_factory=dict)
    layer_effects: list[dict[str, Any]] = field(default_factory=list)
    """Per layer (:func:`layer_effects`): the policy's load completion minus FIFO's, measured and predicted."""
    in_order_excess_us: float | None = None
    """What the live policy costs where the prediction says it changes nothing (:func:`in_order_excess_us`)."""

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}  # type: ignore[attr-defined]


def layer_effects(layers: dict[str, dict[str, list[float]]]) -> list[dict[str, Any]]:
    """Per layer, the policy's mean load completion minus FIFO's in us: ``measured`` (policy runs against
    FIFO runs), ``predicted`` (the policy's replay against the FIFO replay of the same runs, so the FIFO
    replay's own error cancels) and ``miss`` = measured - predicted; only the layers all four profiles
    have (a layer missing from one is left out). [] without all four profiles."""
    need = ("predicted", "measured", "fifo_replayed", "fifo_measured")
    if not all(layers.get(k, {}).get("layer") for k in need):
        return []

    def done(kind: str, layer: float) -> float:
        return layers[kind]["load_done_ms"][layers[kind]["layer"].index(layer)]

    predicted = layers["predicted"]
    out = []
    for x in sorted(set.intersection(*(set(layers[k]["layer"]) for k in need))):
        meas = (done("measured", x) - done("fifo_measured", x)) * 1e3
        pred = (done("predicted", x) - done("fifo_replayed", x)) * 1e3
        in_order = predicted["in_order"][predicted["layer"].index(x)] == 1.0 if "in_order" in predicted \
            else abs(pred) < UNCHANGED_US
        out.append({"layer": x, "measured_us": meas, "predicted_us": pred, "miss_us": meas - pred,
                    "in_order": in_order})
    return out


UNCHANGED_US = 1.0
"""Summaries stored before the replay marked in-order layers: a layer whose predicted completion is within
this of FIFO's is taken as one the policy serves in order."""


def in_order_layers(effects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The layers the policy's replay serves in FIFO order in every step (``in_order``)."""
    return [e for e in effects if e["in_order"]]


def in_order_excess_us(effects: list[dict[str, Any]]) -> float | None:
    """Mean ``miss`` over the layers the policy's replay serves in FIFO order (:func:`in_order_layers`):
    what running the policy live costs (or saves) where its decisions reorder nothing, beyond the cost per
    dequeue the prediction charges (:mod:`.decision`): its effect on the other threads, a wake-up from a
    sleep in ``get()`` instead of in the task's own wait. A difference of means over the runs, without a
    confidence bound: read it next to the noise. None when the policy reorders every layer."""
    xs = [e["miss_us"] for e in in_order_layers(effects)]
    return statistics.fmean(xs) if xs else None


def gain_error_pct(predicted_ms: float, measured_ms: float, noise_ms: float) -> float:
    """The fidelity number: error of the predicted gain relative to max(|measured gain|, noise)."""
    scale = max(abs(measured_ms), noise_ms)
    if scale <= 0:
        return 0.0 if predicted_ms == measured_ms else float("inf")
    return 100 * abs(predicted_ms - measured_ms) / scale


def compare(fifo_replayed: list[RunSummary], fifo_measured: list[RunSummary], policy: str,
            policy_measured: list[RunSummary], *, cfg_label: str,
            calibrated: list[RunSummary] | None = None, dispatch_ns: int = 0) -> Comparison:
    """Predicted vs measured for ``policy`` on one configuration; the measured verdict by the same rules.
    ``calibrated``: the FIFO runs replayed again with the policy's measured cost per dequeue
    (``dispatch_ns``, :func:`dispatch_cost_ns`)."""
    if policy not in fifo_replayed[0].figures:
        raise ValueError(f"policy {policy!r} was not replayed for {cfg_label!r}")
    predicted = {m: spread([float(r.figures[policy][m]) for r in fifo_replayed]) for m in METRICS}
    measured = {m: spread([float(r.figures[MEASURED][m]) for r in policy_measured]) for m in METRICS}
    fifo_meas = {m: spread([float(r.figures[MEASURED][m]) for r in fifo_measured]) for m in METRICS}
    pred_gain = statistics.fmean(r.figures["fifo"]["ttft_ms_mean"] - r.figures[policy]["ttft_ms_mean"]
                                 for r in fifo_replayed)
    meas_gain = fifo_meas["ttft_ms_mean"]["mean"] - measured["ttft_ms_mean"]["mean"]
    noise = max(fifo_meas["ttft_ms_mean"]["stdev"], measured["ttft_ms_mean"]["stdev"])
    cal_gain = statistics.fmean(r.figures["fifo"]["ttft_ms_mean"] - r.figures[policy]["ttft_ms_mean"]
                                for r in calibrated) if calibrated else pred_gain
    pairs, note = pair_by_seed(fifo_measured, policy_measured)
    verdict = _measured_verdict(fifo_replayed, fifo_measured, policy, policy_measured, cfg_label, pairs)
    worst = _measured_verdict(fifo_replayed, fifo_measured, policy, policy_measured, cfg_label, pairs,
                              worst_pair=True) if pairs else None
    alone = _predicted_verdict(fifo_replayed, policy, cfg_label)
    layers = {
        "predicted": _mean_profile([r.layers.get(policy, {}) for r in fifo_replayed]),
        "measured": _mean_profile([r.layers.get(MEASURED, {}) for r in policy_measured]),
        "fifo_replayed": _mean_profile([r.layers.get("fifo", {}) for r in fifo_replayed]),
        "fifo_measured": _mean_profile([r.layers.get(MEASURED, {}) for r in fifo_measured]),
    }
    effects = layer_effects(layers)
    return Comparison(cfg_label, policy, [r.run_id for r in fifo_replayed], [r.run_id for r in policy_measured],
                      predicted, measured, fifo_meas, pred_gain, meas_gain, noise,
                      gain_error_pct(pred_gain, meas_gain, noise), dispatch_ns / 1e3, cal_gain,
                      gain_error_pct(cal_gain, meas_gain, noise), layers, verdict.verdict,
                      f"{verdict.reason} [{note}]",
                      {"gains": verdict.gains, "noise_ms": verdict.noise_ms}, alone.verdict,
                      alone.reason, {"gains": alone.gains, "noise_ms": alone.noise_ms},
                      "seed" if pairs else "none", note,
                      worst.verdict if worst else "n/a",
                      worst.reason if worst else "no worst pair: the runs are not paired by seed",
                      {"gains": worst.gains, "noise_ms": worst.noise_ms} if worst else {},
                      effects, in_order_excess_us(effects))


def _predicted_verdict(fifo_replayed: list[RunSummary], policy: str, cfg_label: str) -> ConfigVerdict:
    """The prediction's verdict with ``policy`` as the only alternative (the configuration's verdict picks
    the best of every replayed policy, so its reason may name another one)."""
    runs = [RunSummary(run_id=r.run_id, cfg_label=cfg_label,
                       figures={"fifo": r.figures["fifo"], policy: r.figures[policy]},
                       fifo_errors_ns=r.fifo_errors_ns, service_ns=r.service_ns, hol_events=r.hol_events,
                       hol_ms=r.hol_ms, layers={k: v for k, v in r.layers.items() if k in ("fifo", policy)})
            for r in fifo_replayed]
    return decide(runs, cfg_label=cfg_label)


_SEED = re.compile(r"(?:^|[-_.])s(\d+)$")


def seed_label(run_id: str) -> int | None:
    """The seed a run id names (``...-s<seed>``: ``kvtrace demo``'s ``demo-hol-<stamp>-s3``, the
    fidelity bench's ``up-fifo-s003``), or None. Runs of the same seed ran the same input."""
    m = _SEED.search(run_id)
    return int(m.group(1)) if m else None


def pair_by_seed(fifo: list[RunSummary], policy: list[RunSummary]
                 ) -> tuple[list[tuple[RunSummary, RunSummary]] | None, str]:
    """(FIFO run, policy run) of the same seed, in seed order, when every run of both sets carries a seed
    label, each seed once, and both sets have the same seeds; else None. Second: the note saying which."""
    counts = f"{len(fifo)} FIFO / {len(policy)} policy runs"
    f_seed = {seed_label(r.run_id): r for r in fifo}
    p_seed = {seed_label(r.run_id): r for r in policy}
    if None in f_seed or None in p_seed:
        why = "run ids carry no seed label (-s<seed>)"
    elif len(f_seed) < len(fifo) or len(p_seed) < len(policy):
        why = "a seed label repeats"
    elif set(f_seed) != set(p_seed):
        why = "the seed labels of the two sets differ"
    else:
        return [(f_seed[k], p_seed[k]) for k in sorted(f_seed)], f"paired by seed: {len(fifo)} pairs"  # type: ignore[type-var]
    note = f"not paired ({why}): Welch two-sample bound over all {counts}"
    if len(fifo) != len(policy):
        logger.warning("--measured: %s; unequal counts, every run used", note)
    return None, note


def _measured_verdict(fifo_replayed: list[RunSummary], fifo_measured: list[RunSummary], policy: str,
                      policy_measured: list[RunSummary], cfg_label: str,
                      pairs: list[tuple[RunSummary, RunSummary]] | None, *, worst_pair: bool = False
                      ) -> ConfigVerdict:
    """The measured verdict: on seed pairs by the paired confidence bound (``worst_pair``: by the replays'
    worst-run rule), else by Welch's bound over both sets (no run dropped, names do not matter)."""
    by_id = {r.run_id: r for r in fifo_replayed}

    def fifo_side(f: RunSummary, figures: dict[str, Any], layers: dict[str, Any], run_id: str) -> RunSummary:
        rep = by_id[f.run_id]
        return RunSummary(run_id=run_id, cfg_label=cfg_label, figures=figures, fifo_errors_ns=rep.fifo_errors_ns,
                          service_ns=rep.service_ns, hol_events=rep.hol_events, hol_ms=rep.hol_ms, layers=layers)

    if pairs is not None:
        runs = [fifo_side(f, {"fifo": f.figures[MEASURED], policy: p.figures[MEASURED]},
                          {"fifo": f.layers.get(MEASURED, {}), policy: p.layers.get(MEASURED, {})},
                          f"{f.run_id}|{p.run_id}") for f, p in pairs]
        return decide(runs, cfg_label=cfg_label, independent=not worst_pair)
    fifo = [fifo_side(f, {"fifo": f.figures[MEASURED]}, {"fifo": f.layers.get(MEASURED, {})}, f.run_id)
            for f in sorted(fifo_measured, key=lambda r: r.run_id)]
    pol = [RunSummary(run_id=p.run_id, cfg_label=cfg_label, figures={policy: p.figures[MEASURED]},
                      fifo_errors_ns=[], service_ns=[], hol_events=0, hol_ms=0.0,
                      layers={policy: p.layers.get(MEASURED, {})})
           for p in sorted(policy_measured, key=lambda r: r.run_id)]
    return decide(fifo, cfg_label=cfg_label, policy_runs={policy: pol})


def _mean_profile(profiles: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    profiles = [p for p in profiles if p and p.get("layer")]
    if not profiles:
        return {}
    common = sorted(set.intersection(*(set(p["layer"]) for p in profiles)))
    out: dict[str, list[float]] = {"layer": common}
    for key in ("load_done_ms", "consumer_wait_ms", "in_order"):
        if all(key in p for p in profiles):  # in_order: the fraction of runs that served the layer in order
            out[key] = [statistics.fmean(p[key][p["layer"].index(x)] for p in profiles) for x in common]
    return out
