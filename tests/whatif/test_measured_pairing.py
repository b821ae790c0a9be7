"""The measured verdict pairs a FIFO run with a policy run only when both ran the same seed; otherwise it
compares the two sets by Welch's two-sample bound, with every run (review5 #5, #6, #17).

Hand-made run summaries shaped like ``measured.measured_summary`` (figures under ``measured``) and like
the FIFO runs' replays (figures per policy), so the rule alone is under test.
"""

from __future__ import annotations

import logging
import statistics

import pytest

from otel_kvtrace.whatif import verdict as verdict_module
from otel_kvtrace.whatif.measured import DISPATCH, MEASURED, compare, pair_by_seed, seed_label
from otel_kvtrace.whatif.replay import RunSummary
from otel_kvtrace.whatif.verdict import PAIRED, WELCH, WORST, confidence_bounds, decide, t95, welch_bounds

POLICY = "ready_queue"
LAYERS = {"layer": [0.0, 1.0], "load_done_ms": [1.0, 2.0], "consumer_wait_ms": [0.1, 0.2]}


def figures(ttft: float, *, p99: float | None = None, inflight: int = 4) -> dict[str, float | int]:
    return {"ttft_ms_mean": ttft, "ttft_ms_p99": p99 if p99 is not None else ttft * 1.5,
            "consumer_wait_ms_per_step": ttft / 2, "consumer_wait_ms_p99_layer": 1.0,
            "peak_inflight": inflight, "throughput_tasks_per_s": 1000.0}


def replayed(run_id: str, ttft: float, gain: float = 3.0) -> RunSummary:
    """A FIFO run replayed under FIFO and the policy (validated, HOL in it)."""
    return RunSummary(run_id=run_id, cfg_label="cfg", figures={"fifo": figures(ttft), POLICY: figures(ttft - gain)},
                      fifo_errors_ns=[10] * 10, service_ns=[1000] * 10, hol_events=2, hol_ms=2.0,
                      layers={"fifo": LAYERS, POLICY: LAYERS})


def measured(run_id: str, ttft: float) -> RunSummary:
    return RunSummary(run_id=run_id, cfg_label="cfg", figures={MEASURED: {**figures(ttft), DISPATCH: 0}},
                      fifo_errors_ns=[], service_ns=[], hol_events=0, hol_ms=0.0, layers={MEASURED: LAYERS})


FIFO_TTFT = [10.0, 11.0, 12.0, 13.0, 14.0, 15.0, 16.0, 17.0]
POLICY_TTFT = [t - 3.0 + j for t, j in zip(FIFO_TTFT, (0.05, -0.05, 0.1, 0.0, -0.1, 0.05, 0.0, -0.05), strict=True)]


def ab(fifo_ids: list[str], policy_ids: list[str], fifo_ttft: list[float] = FIFO_TTFT,
       policy_ttft: list[float] = POLICY_TTFT):  # type: ignore[no-untyped-def]
    fifo_rep = [replayed(r, t) for r, t in zip(fifo_ids, fifo_ttft, strict=True)]
    fifo_meas = [measured(r, t) for r, t in zip(fifo_ids, fifo_ttft, strict=True)]
    pol = [measured(r, t) for r, t in zip(policy_ids, policy_ttft, strict=True)]
    return compare(fifo_rep, fifo_meas, POLICY, pol, cfg_label="cfg")


def old_pairing_bound(policy_ids: list[str]) -> float:
    """The bound of the rule before: run k with run k in run-id order."""
    f = [t for _, t in sorted(zip([f"fifo-{k}" for k in range(1, 9)], FIFO_TTFT, strict=True))]
    p = [t for _, t in sorted(zip(policy_ids, POLICY_TTFT, strict=True))]
    return confidence_bounds([a - b for a, b in zip(f, p, strict=True)])[0]


def test_renaming_unpaired_runs_does_not_change_the_welch_verdict() -> None:
    fifo_ids = [f"fifo-{k}" for k in range(1, 9)]
    named = [f"rq-{k}" for k in range(1, 9)]  # rq-k ran after fifo-k, not the same input: no seed label
    renamed = named[::-1]
    # run-id order pairs rq-k with fifo-k in one naming and with fifo-(9-k) in the other: the paired
    # bound of the rule before moved from "switch" (2.9 ms > noise 2.45) to "keep" (below 0)
    assert old_pairing_bound(named) > 2.45 > 0 > old_pairing_bound(renamed)
    a, b = ab(fifo_ids, named), ab(fifo_ids, renamed)
    for c in (a, b):
        g = c.measured_verdict["gains"][POLICY]
        assert c.pairing == "none" and g["bound"] == WELCH
        assert "Welch" in c.reason and "not paired (run ids carry no seed label" in c.reason
        assert c.verdict_worst == "n/a"  # no worst pair without pairs
    assert a.verdict == b.verdict and a.reason == b.reason
    assert a.measured_verdict["gains"][POLICY]["lower_bound_ms"] == b.measured_verdict["gains"][POLICY]["lower_bound_ms"]
    lower, _, df = welch_bounds(FIFO_TTFT, POLICY_TTFT)
    assert a.measured_verdict["gains"][POLICY]["lower_bound_ms"] == pytest.approx(lower)
    se = (statistics.variance(FIFO_TTFT) / 8 + statistics.variance(POLICY_TTFT) / 8) ** 0.5
    assert 13 < df < 14 and lower == pytest.approx(3.0 - t95(13) * se, abs=0.02)


def test_unequal_counts_use_every_run_and_say_so(caplog: pytest.LogCaptureFixture) -> None:
    # FIFO seeds 1-4, policy seeds 1-6: the rule before zipped 4 pairs and dropped 2 policy runs silently
    fifo_ids = [f"demo-hol-x-s{k}" for k in range(1, 5)]
    pol_ids = [f"demo-hol-y-s{k}" for k in range(1, 7)]
    pol_ttft = [t - 3.0 for t in (10.0, 11.0, 12.0, 13.0, 20.0, 21.0)]  # the extra two runs are slow
    with caplog.at_level(logging.WARNING, logger="otel_kvtrace.whatif.measured"):
        c = ab(fifo_ids, pol_ids, FIFO_TTFT[:4], pol_ttft)
    g = c.measured_verdict["gains"][POLICY]
    assert c.pairing == "none" and g["bound"] == WELCH
    assert g["ttft_gain_ms"]["fifo_per_run"] == FIFO_TTFT[:4] and g["ttft_gain_ms"]["policy_per_run"] == pol_ttft
    assert g["ttft_gain_ms"]["mean"] == pytest.approx(statistics.fmean(FIFO_TTFT[:4]) - statistics.fmean(pol_ttft))
    assert "the seed labels of the two sets differ" in c.reason and "4 FIFO / 6 policy runs" in c.reason
    assert "unequal counts" in caplog.text
    assert len(c.measured["ttft_ms_mean"]["per_run"]) == 6


def test_seed_labels_that_match_pair_the_runs_by_seed() -> None:
    # FIFO run ids sort in the reverse seed order: pairing by run id would pair seed 1 with seed 8
    fifo_ids = [f"z{9 - k}-s{k}" for k in range(1, 9)]
    pol_ids = [f"up-rq-s{k:03d}" for k in range(1, 9)]
    c = ab(fifo_ids, pol_ids)
    g = c.measured_verdict["gains"][POLICY]
    paired = [f - p for f, p in zip(FIFO_TTFT, POLICY_TTFT, strict=True)]
    assert c.pairing == "seed" and g["bound"] == PAIRED and "paired by seed: 8 pairs" in c.reason
    assert g["ttft_gain_ms"]["per_run"] == pytest.approx(paired)
    assert g["lower_bound_ms"] == pytest.approx(confidence_bounds(paired)[0])
    assert c.verdict == f"switch to {POLICY}"
    # the same pairs by the replays' rule (worst pair), printed next to the prediction's
    w = c.measured_evidence_worst["gains"][POLICY]
    assert w["bound"] == WORST and w["lower_bound_ms"] == pytest.approx(min(paired))
    assert c.verdict_worst == f"switch to {POLICY}" and "gain lower bound" in c.reason_worst


def test_seed_labels() -> None:
    assert [seed_label(r) for r in ("demo-hol-20261202T061900-s3", "up-fifo-s003", "fifo-1", "rq-s", "runs12")] == [
        3, 3, None, None, None]
    a, b = [measured(f"a-s{k}", 1.0) for k in (1, 1, 2)], [measured(f"b-s{k}", 1.0) for k in (1, 2, 3)]
    assert pair_by_seed(a, b)[0] is None and "repeats" in pair_by_seed(a, b)[1]


def test_one_measured_pair_has_no_confidence_bound_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    # even where the repeat count does not stop it first, the reason never prints an infinite bound
    monkeypatch.setattr(verdict_module, "MIN_REPEATS", 1)
    one = [RunSummary(run_id="f|p", cfg_label="cfg", figures={"fifo": figures(12.0), POLICY: figures(11.0)},
                      fifo_errors_ns=[10] * 10, service_ns=[1000] * 10, hol_events=2, hol_ms=2.0)]
    v = decide(one, independent=True)
    assert v.verdict == "keep FIFO" and v.reason.startswith("one measured pair: no confidence bound")
    assert "inf" not in v.reason
    fifo = [RunSummary(run_id=f"f{k}", cfg_label="cfg", figures={"fifo": figures(12.0 + k)},
                       fifo_errors_ns=[10] * 10, service_ns=[1000] * 10, hol_events=2, hol_ms=2.0) for k in range(3)]
    w = decide(fifo, policy_runs={POLICY: [RunSummary(run_id="p", cfg_label="cfg", figures={POLICY: figures(9.0)},
                                                      fifo_errors_ns=[], service_ns=[], hol_events=0, hol_ms=0.0)]})
    assert w.verdict == "keep FIFO" and "no confidence bound" in w.reason and "inf" not in w.reason


def test_welch_bound_and_fractional_degrees_of_freedom() -> None:
    assert t95(13.9) == t95(13) and t95(float("inf")) == pytest.approx(1.645, abs=1e-3)
    lo, hi, df = welch_bounds([1.0, 2.0, 3.0], [1.0, 1.0, 1.0])  # all variance on one side: df = n - 1
    assert df == pytest.approx(2.0) and lo == pytest.approx(1.0 - 2.920 * (1 / 3) ** 0.5)
    assert hi == pytest.approx(1.0 + 2.920 * (1 / 3) ** 0.5)
    assert welch_bounds([2.0, 2.0], [1.0, 1.0]) == (1.0, 1.0, float("inf"))


def test_unpaired_regressions_use_the_welch_upper_bound() -> None:
    def runs(name: str, ttft: list[float], p99: list[float], inflight: int = 4) -> list[RunSummary]:
        return [RunSummary(run_id=f"{name}{k}", cfg_label="cfg", figures={name: figures(t, p99=q, inflight=inflight)},
                           fifo_errors_ns=[10] * 10, service_ns=[1000] * 10, hol_events=2, hol_ms=2.0)
                for k, (t, q) in enumerate(zip(ttft, p99, strict=True))]

    fifo = runs("fifo", [12.0, 12.2, 11.8, 12.1], [16.0, 16.5, 15.5, 16.0])
    better = decide(fifo, policy_runs={POLICY: runs(POLICY, [9.0, 9.1, 8.9, 9.0], [15.0, 15.8, 14.8, 15.1])})
    assert better.verdict == f"switch to {POLICY}", better.reason
    assert "Welch 95% lower confidence bound" in better.reason and "4 FIFO and 4 ready_queue runs" in better.reason
    # p99 1 ms better on average above; 1 ms worse here: the upper bound of the mean change is above 0
    worse = decide(fifo, policy_runs={POLICY: runs(POLICY, [9.0, 9.1, 8.9, 9.0], [17.0, 17.5, 16.8, 17.2])})
    assert worse.verdict == "keep FIFO" and "p99 TTFT regression" in worse.reason
    assert "(Welch 95% upper confidence bound of the mean change)" in worse.reason
    more = decide(fifo, policy_runs={POLICY: runs(POLICY, [9.0, 9.1, 8.9, 9.0], [15.0] * 4, inflight=5)})
    assert "peak in-flight regression" in more.reason
    few = decide(fifo, policy_runs={POLICY: runs(POLICY, [9.0, 9.1], [15.0, 15.0])})
    assert few.verdict == "keep FIFO" and "only 4 FIFO and 2 ready_queue runs; need >= 3 of each" in few.reason
