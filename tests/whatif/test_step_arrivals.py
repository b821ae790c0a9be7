"""A step's tasks are enqueued by the forward after the previous step: when a policy ends a step later,
the next step's arrivals move later with it (a model fix; docs/whatif.md "Fidelity").

The old model kept every arrival at its recorded time, so a policy slower than FIFO carried its backlog
into the next step and the step after: the TTFT estimate (from the step's first enqueue) grew from step
to step, in the replay only (measured live: ``gate_group`` predicted -4.1 ms, measured -0.2 ms on ``hol``).
"""

from __future__ import annotations

from otel_kvtrace.whatif.metrics import check_constraints, step_figures
from otel_kvtrace.whatif.replay import replay_run
from otel_kvtrace.whatif.task import ReplayTask, add_dispatch_gaps


def steps(n: int, period: int = 210) -> list[ReplayTask]:
    """``n`` steps of two 100 ns loads (layers 0 and 1, the final), recorded back to back from each
    step's start (every ``period`` ns); the forward leaves each wait when the load completed."""
    tasks = []
    for s in range(n):
        t0 = s * period
        for layer in (0, 1):
            start = t0 + 100 * layer
            tasks.append(ReplayTask("q", 2 * s + layer, s, layer, t0, (0, 0, 0, 100), final_layer=layer == 1,
                                    recorded_start_ns=start, recorded_complete_ns=start + 100, run_id="r",
                                    cfg_label="c"))
    add_dispatch_gaps(tasks)
    return tasks


def ttft(run, policy: str) -> list[int]:
    (per,) = run.replays.values()
    return [f.ttft_ns for f in step_figures(per[policy])]


def test_a_slower_policy_delays_the_next_step_instead_of_queueing_it() -> None:
    # ready_queue pays 50 ns per dequeue: each step ends 100 ns later than FIFO's
    run = replay_run(steps(4), policies=["ready_queue"], dispatch_ns={"ready_queue": 50})
    assert ttft(run, "fifo") == [200, 200, 200, 200]
    assert ttft(run, "ready_queue") == [300, 300, 300, 300]  # old model: 300, 390, 480, 570
    (per,) = run.replays.values()
    rep = per["ready_queue"]
    assert rep.arr[2] == 210 + 100 and rep.arr[4] == 420 + 200  # later by the forward's shift so far
    assert check_constraints(rep) == []


def test_a_faster_policy_never_moves_the_next_step_earlier() -> None:
    run = replay_run(steps(3), policies=["ready_queue"])
    (per,) = run.replays.values()
    assert per["ready_queue"].arr == per["fifo"].arr == [0, 0, 210, 210, 420, 420]
