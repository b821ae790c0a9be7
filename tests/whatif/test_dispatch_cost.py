"""The live scheduler's own cost per dequeue, as a replay parameter (a model fix; docs/whatif.md "Fidelity").

The old model gave a policy the FIFO run's dispatch gaps only, so a policy whose ``get()`` costs more
than ``queue.Queue.get()`` was predicted too fast by that cost on every dequeue of a busy thread.
"""

from __future__ import annotations

import pytest

from otel_kvtrace.whatif.engine import QueueArrays, replay_queue
from otel_kvtrace.whatif.measured import MEASURED, busy_dispatch_ns, compare, dispatch_cost_ns, measured_summary
from otel_kvtrace.whatif.metrics import check_constraints
from otel_kvtrace.whatif.policy import get_policy
from otel_kvtrace.whatif.replay import replay_run
from otel_kvtrace.whatif.task import ReplayTask, add_dispatch_gaps

D = 7  # the policy's extra cost per dequeue, ns (toy units)


def task(seq: int, layer: int, *, work: int = 100, **kw: object) -> ReplayTask:
    return ReplayTask("q", seq, 0, layer, 0, (0, 0, 0, work), **kw)  # type: ignore[arg-type]


def recorded(n: int, gap: int, *, scheduler: str = "", run_id: str = "r") -> list[ReplayTask]:
    """``n`` tasks queued at 0 and served back to back, ``gap`` ns of dispatch before each, ``work`` 100."""
    tasks = []
    t = 0
    for i in range(n):
        start = t + gap
        t = start + 100
        tasks.append(ReplayTask("q", i, 0, i, 0, (0, 0, 0, 100), final_layer=i == n - 1, recorded_start_ns=start,
                                recorded_complete_ns=t, run_id=run_id, cfg_label="c", scheduler=scheduler))
    add_dispatch_gaps(tasks)
    return tasks


@pytest.mark.parametrize("policy", ["ready_queue", "gate_group"])
def test_every_dequeue_of_a_busy_thread_pays_the_policy_s_cost(policy: str) -> None:
    tasks = [task(i, i, final_layer=i == 3) for i in range(4)]
    base = replay_queue(QueueArrays.from_tasks(tasks), get_policy(policy))
    rep = replay_queue(QueueArrays.from_tasks(tasks), get_policy(policy), dispatch_ns=D)
    assert base.complete == [100, 200, 300, 400]
    assert rep.complete == [100 + D, 200 + 2 * D, 300 + 3 * D, 400 + 4 * D]
    assert check_constraints(rep) == []


def test_fifo_never_gets_the_policy_s_cost() -> None:
    run = replay_run(recorded(4, 5), policies=["ready_queue"], dispatch_ns={"fifo": 99, "ready_queue": D})
    fifo = run.replays["q"]["fifo"]
    assert fifo.complete == [105, 210, 315, 420]  # the recording, unchanged
    assert run.replays["q"]["ready_queue"].complete == [105 + D, 210 + 2 * D, 315 + 3 * D, 420 + 4 * D]


def test_the_cost_is_read_from_busy_in_order_dequeues() -> None:
    assert busy_dispatch_ns(recorded(5, 30)) == 30
    # a dequeue after an idle thread (arrival after the previous completion) is a wake-up: not counted
    tasks = recorded(3, 30)
    late = ReplayTask("q", 3, 0, 3, 1000, (0, 0, 0, 100), recorded_start_ns=1500, recorded_complete_ns=1600)
    assert busy_dispatch_ns([*tasks, late]) == 30
    # a bypass (seq order broken) is a scheduling decision, not the loop's cost: not counted
    a = ReplayTask("q", 0, 0, 0, 0, (0, 0, 0, 100), recorded_start_ns=500, recorded_complete_ns=600)
    b = ReplayTask("q", 1, 0, 1, 0, (0, 0, 0, 100), recorded_start_ns=10, recorded_complete_ns=110)
    c = ReplayTask("q", 2, 0, 2, 0, (0, 0, 0, 100), recorded_start_ns=650, recorded_complete_ns=750)
    assert busy_dispatch_ns([a, b, c]) == 50  # only 0 -> 2 (600 -> 650) is in order and busy


def test_calibrated_prediction_recovers_a_gain_the_old_model_missed() -> None:
    # FIFO and the policy serve the same back-to-back queue in the same order; the policy's get() costs
    # D more per dequeue. Measured: the policy is slower by n * D at the last load. The old model predicts
    # a gain of 0 (error n * D); replayed with the cost taken from the measured runs it is exact.
    n = 6
    fifo = [measured_summary(recorded(n, 5, run_id=f"f{k}"), run_id=f"f{k}", cfg_label="c") for k in range(3)]
    pol = [measured_summary(recorded(n, 5 + D, scheduler="ready_queue", run_id=f"p{k}"), run_id=f"p{k}",
                            cfg_label="c") for k in range(3)]
    assert fifo[0].figures[MEASURED]["dispatch_ns"] == 5
    cost = dispatch_cost_ns(fifo, pol)
    assert cost == D
    plain = [replay_run(recorded(n, 5, run_id=f"f{k}"), policies=["ready_queue"], run_id=f"f{k}",
                        cfg_label="c").summary() for k in range(3)]
    cal = [replay_run(recorded(n, 5, run_id=f"f{k}"), policies=["ready_queue"], run_id=f"f{k}", cfg_label="c",
                      dispatch_ns={"ready_queue": cost}).summary() for k in range(3)]
    c = compare(plain, fifo, "ready_queue", pol, cfg_label="c", calibrated=cal, dispatch_ns=cost)
    assert c.measured_gain_ms == pytest.approx(-n * D / 1e6)
    assert c.predicted_gain_ms == pytest.approx(0.0)  # the old model: no cost, no loss
    assert c.calibrated_gain_ms == pytest.approx(c.measured_gain_ms)
    assert c.dispatch_cost_us == pytest.approx(D / 1e3)
