"""The woken forward waits for the GIL behind the recv thread's run after the load (a model fix;
docs/whatif.md "Fidelity", ``otel_kvtrace/whatif/gil.py``).

The old model replayed every policy with FIFO's recorded wake-up lags. Live, when a load completes, the
forward runs only once the recv thread blocks: under FIFO the recv thread often blocks at once in the next
head's save wait, under ``ready_queue`` it takes a ready task and runs that task's CPU work first, so the
forward wakes later. The model is sized on the FIFO recording only.
"""

from __future__ import annotations

import pytest

from otel_kvtrace.whatif import gil
from otel_kvtrace.whatif.columns import NONE, QueueArrays
from otel_kvtrace.whatif.metrics import check_constraints
from otel_kvtrace.whatif.replay import replay_run
from otel_kvtrace.whatif.task import ReplayTask

STEPS = 40
BASE_LAG = 20_000
CPU = 60_000  # layer 2's CPU work before its copy (ns)


def recording(*, meta_first: bool = False, falling: bool = False) -> list[ReplayTask]:
    """A FIFO recording, ``STEPS`` steps of 4 layers (times in ns, step s starts at s * 1 ms):

    - L0: no dependency, 100 us; the forward waits on it from +10 us and wakes ``BASE_LAG + x`` after it
      completed, where ``x`` (10-49 us, varied per step) is the recv thread's run into L1 before L1 blocks
      in its save wait: lag = 20 us + 1.0 x, what the fit must find;
    - L1: save of layer 0's buffer ready at +500 us; x of CPU work before that wait, then a 100 us copy;
    - L2: ready, ``CPU`` of CPU work then its copy (``copy_at``), 160 us in all;
    - L3: final layer, 100 us. The forward does not wait on L1-L3 (they completed before it came).
    ``meta_first``: L1's x holds a sleeping metadata build starting ``meta`` (0-9 us, unrelated to x) into
    it: the recv thread releases the GIL there, the lag is 20 us + meta, and only the release set with
    ``meta_build`` explains it. ``falling``: the lag falls with x (20 us + 50 us - x), which no GIL wait does.
    """
    out = []
    seq = 0
    for s in range(STEPS):
        b = s * 1_000_000
        x = 10_000 + (s * 7919) % 40_000
        meta = (s * 3217) % 9_000  # where L1's sleeping metadata build starts (``meta_first``)
        lag = BASE_LAG + (meta if meta_first else x)
        if falling:
            lag = BASE_LAG + 50_000 - x
        rows = [
            dict(layer_id=0, work_ns=(0, 0, 0, 100_000), start=b, complete=b + 100_000, copy_at_ns=0,
                 consumer_wait_start_ns=b + 10_000, consumer_wait_end_ns=b + 100_000 + lag),
            dict(layer_id=1, work_ns=(x, 100_000, 0, 0), start=b + 100_000, complete=b + 600_000,
                 ready_save_ns=b + 500_000, wait_for_save_layer=0, copy_at_ns=x,
                 meta_at_ns=meta if meta_first else None),
            dict(layer_id=2, work_ns=(0, 0, 0, CPU + 100_000), start=b + 600_000, complete=b + 760_000,
                 copy_at_ns=CPU),
            dict(layer_id=3, work_ns=(0, 0, 0, 100_000), start=b + 760_000, complete=b + 860_000,
                 final_layer=True, copy_at_ns=0),
        ]
        for r in rows:
            start, complete = r.pop("start"), r.pop("complete")
            out.append(ReplayTask("q", seq, s, arrival_ns=b, recorded_start_ns=start, recorded_complete_ns=complete,
                                  run_id="r", cfg_label="c", **r))  # type: ignore[arg-type]
            seq += 1
    return out


def lags_at_layer0(rep) -> list[int]:  # type: ignore[no-untyped-def]
    q = rep.arrays
    return [rep.fwd_end[s][0] - rep.complete[chain[0]] for s, chain in enumerate(q.chain)]


def test_the_fit_on_the_fifo_recording_finds_the_lag_per_us_of_recv_run() -> None:
    run = replay_run(recording(), policies=["ready_queue"], gil_lag=True)
    model = run.gil["q"]
    assert model is not None and model.points == STEPS and model.release == "copy"
    assert model.slope == pytest.approx(1.0, abs=1e-3)
    assert model.intercept == pytest.approx(BASE_LAG, abs=50)  # (the loop gap is 0 here)


def test_a_policy_that_runs_cpu_work_after_the_load_delays_the_woken_forward() -> None:
    tasks = recording()
    new = replay_run(tasks, policies=["ready_queue"], gil_lag=True)
    old = replay_run(tasks, policies=["ready_queue"], gil_lag=False)
    fifo = new.replays["q"]["fifo"]
    recorded = [t.consumer_wait_end_ns - t.recorded_complete_ns for t in tasks if t.layer_id == 0]  # type: ignore[operator]
    assert lags_at_layer0(fifo) == recorded  # FIFO is its own reference: unchanged
    rq_new, rq_old = new.replays["q"]["ready_queue"], old.replays["q"]["ready_queue"]
    # ready_queue serves L2 while L1 waits on its save: after L0 the recv thread runs CPU (60 us) before
    # it blocks, instead of x. The old model kept FIFO's lag (20 us + x); the forward now wakes 20 + 60 us
    # after L0 whatever x was.
    order = sorted(range(4), key=lambda i: rq_new.start[i])
    assert [rq_new.arrays.layer[i] for i in order] == [0, 2, 1, 3]
    assert lags_at_layer0(rq_old) == recorded
    assert lags_at_layer0(rq_new) == pytest.approx([BASE_LAG + CPU] * STEPS, abs=100)
    assert check_constraints(rq_new) == []


def test_the_release_points_are_chosen_by_the_fit() -> None:
    # the lag follows the start of L1's sleeping metadata build, not its copy: the fit picks that set
    model = replay_run(recording(meta_first=True), policies=["ready_queue"]).gil["q"]
    assert model is not None and model.release == "meta+copy"
    assert model.slope == pytest.approx(1.0, abs=1e-3) and model.intercept == pytest.approx(BASE_LAG, abs=50)


def test_a_falling_lag_fits_a_flat_line_at_the_median_lag() -> None:
    # the LAD slope is -1 here: clamped to 0, the intercept must be the lags' median, not the
    # unclamped line's intercept (20 + 50 us), which would add about 20 us to every fitted lag
    import statistics

    tasks = recording(falling=True)
    model = replay_run(tasks, policies=["ready_queue"]).gil["q"]
    lags = [t.consumer_wait_end_ns - t.recorded_complete_ns for t in tasks if t.layer_id == 0]  # type: ignore[operator]
    assert model is not None and model.slope == 0.0
    assert model.intercept == pytest.approx(statistics.median(lags))
    assert model.residual_ns == pytest.approx(statistics.median(abs(y - statistics.median(lags)) for y in lags))


def test_the_lad_line_is_not_pulled_by_a_stall_tail() -> None:
    xs = [1000.0 * k for k in range(100)]  # runs of 0-99 us
    ys = [20_000.0 + x for x in xs]
    ys[::10] = [y + 50e6 for y in ys[::10]]  # one wait in ten stalled for 50 ms
    a, b = gil.lad_line(xs, ys)
    assert b == pytest.approx(1.0, abs=0.01) and a == pytest.approx(20_000, abs=500)


def test_too_few_blocked_waits_fit_nothing_and_change_nothing() -> None:
    tasks = recording()[: 4 * (gil.MIN_POINTS - 1)]
    run = replay_run(tasks, policies=["ready_queue"])
    assert run.gil["q"] is None
    old = replay_run(tasks, policies=["ready_queue"], gil_lag=False)
    assert run.replays["q"]["ready_queue"].fwd_end == old.replays["q"]["ready_queue"].fwd_end
    assert NONE not in run.replays["q"]["ready_queue"].complete
    assert QueueArrays.from_tasks(tasks).n == len(tasks)
