"""The verdict rules, one reason at a time, on hand-made run summaries."""

from __future__ import annotations

from otel_kvtrace.whatif.replay import RunSummary
from otel_kvtrace.whatif.verdict import decide


def figures(ttft: float, *, p99: float | None = None, inflight: int = 4) -> dict[str, float | int]:
    return {"ttft_ms_mean": ttft, "ttft_ms_p99": p99 if p99 is not None else ttft * 1.5,
            "consumer_wait_ms_per_step": ttft / 2, "consumer_wait_ms_p99_layer": 1.0,
            "peak_inflight": inflight, "throughput_tasks_per_s": 1000.0}


def run(fifo: float, rq: float, *, hol: int = 2, error_ns: int = 10, rq_p99: float | None = None,
        rq_inflight: int = 4, i: int = 0) -> RunSummary:
    return RunSummary(
        run_id=f"r{i}", cfg_label="cfg",
        figures={"fifo": figures(fifo), "ready_queue": figures(rq, p99=rq_p99, inflight=rq_inflight)},
        fifo_errors_ns=[error_ns] * 10, service_ns=[1000] * 10, hol_events=hol, hol_ms=1.0 * hol)


def test_switch_when_gain_lower_bound_beats_noise() -> None:
    v = decide([run(10.0, 9.0, i=0), run(10.2, 9.1, i=1), run(9.9, 8.95, i=2)])
    assert v.verdict == "switch to ready_queue"
    assert v.validated and v.fifo_median_error_pct == 1.0
    assert abs(v.gains["ready_queue"]["lower_bound_ms"] - 0.95) < 1e-9
    assert [round(g, 9) for g in v.gains["ready_queue"]["ttft_gain_ms"]["per_run"]] == [1.0, 1.1, 0.95]


def test_fifo_not_reproduced_compares_no_policy() -> None:
    v = decide([run(10.0, 9.0, error_ns=80, i=k) for k in range(3)])
    assert v.verdict == "keep FIFO"
    assert "does not reproduce" in v.reason and "8.0%" in v.reason
    assert list(v.policies) == ["fifo"] and v.gains == {}


def test_one_run_not_reproduced_blocks_every_comparison_even_when_the_pool_looks_fine() -> None:
    # two accurate runs and one with 40% median error: pooled, the median error is 1.0%
    v = decide([run(10.0, 9.0, i=0), run(10.2, 9.1, i=1), run(9.9, 8.95, error_ns=400, i=2)])
    assert v.fifo_median_error_pct == 1.0  # the pooled figure alone would pass
    assert not v.validated and v.verdict == "keep FIFO"
    assert "does not reproduce" in v.reason and "run r2" in v.reason and "40.0%" in v.reason
    assert (v.fifo_worst_run, v.fifo_worst_run_error_pct) == ("r2", 40.0)
    assert list(v.policies) == ["fifo"] and v.gains == {}


def test_fewer_than_three_runs() -> None:
    v = decide([run(10.0, 5.0, i=0), run(10.0, 5.0, i=1)])
    assert v.verdict == "keep FIFO" and "only 2 independent run(s)" in v.reason


def test_hol_must_be_present_in_every_run() -> None:
    v = decide([run(10.0, 9.0, i=0), run(10.0, 9.0, hol=0, i=1), run(10.0, 9.0, i=2)])
    assert v.verdict == "keep FIFO" and v.reason.startswith("no stable HOL (HOL in 2 of 3 runs)")


def test_gain_below_noise() -> None:
    # FIFO's mean TTFT moves by ~1 ms between runs; the gain is 0.3 ms
    v = decide([run(9.0, 8.7, i=0), run(10.0, 9.7, i=1), run(11.0, 10.7, i=2)])
    assert v.verdict == "keep FIFO"
    assert v.reason.startswith("HOL present but gain below noise")


def test_a_negative_run_blocks_the_switch_even_if_the_mean_gain_is_large() -> None:
    v = decide([run(10.0, 8.0, i=0), run(10.0, 8.0, i=1), run(10.0, 10.1, i=2)])
    assert v.verdict == "keep FIFO"


def test_tail_and_inflight_regressions_block_the_switch() -> None:
    v = decide([run(10.0, 9.0, rq_p99=20.0, i=k) for k in range(3)])
    assert v.verdict == "keep FIFO" and "p99 TTFT regression" in v.reason
    v = decide([run(10.0, 9.0, rq_inflight=6, i=k) for k in range(3)])
    assert v.verdict == "keep FIFO" and "peak in-flight regression" in v.reason


def test_the_p99_tolerance_is_stated_where_it_is_used() -> None:
    # FIFO's p99 is 15.0 ms; ready_queue's is 0.5% worse: inside the 1% tolerance, and the reason says so
    v = decide([run(10.0, 9.0, rq_p99=15.075, i=k) for k in range(3)])
    assert v.verdict == "switch to ready_queue"
    assert "no p99 TTFT regression beyond 1%" in v.reason and "no peak in-flight increase" in v.reason
    v = decide([run(10.0, 9.0, rq_p99=15.3, i=k) for k in range(3)])  # 2% worse: blocked
    assert v.verdict == "keep FIFO" and "p99 TTFT regression (> 1%)" in v.reason


def test_both_regressions_are_named() -> None:
    v = decide([run(10.0, 9.0, rq_p99=20.0, rq_inflight=6, i=k) for k in range(3)])
    assert v.verdict == "keep FIFO"
    assert "p99 TTFT regression (> 1%) and peak in-flight regression" in v.reason


def test_whatif_help_states_every_rule() -> None:
    from click.testing import CliRunner

    from otel_kvtrace.cli import main

    text = " ".join(CliRunner().invoke(main, ["whatif", "--help"]).output.split())
    assert "HOL in every run" in text
    assert "p99 TTFT no more than 1% above FIFO's" in text
    assert "peak in-flight" in text and "every run" in text
    assert "5%" in text


def test_summary_round_trips_through_json_dict() -> None:
    r = run(10.0, 9.0)
    assert RunSummary.from_dict(r.to_dict()) == r
