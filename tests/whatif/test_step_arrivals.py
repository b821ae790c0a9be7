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


def test_a_later_step_meets_its_slot_releases_later_too() -> None:
    """The external slot of a step is released by a sibling connector's send in the same engine step, so
    when a policy starts the next step later, that step's releases come later with it. The old model kept
    them at their recorded (absolute) time: the later step found its slot already free, and a slower
    policy was credited the slot wait (measured live on the slow-slot replica, interleaved, 40 seeds:
    ready_queue -0.43 ms, predicted -0.003; with the releases moved, -0.46 on 6 of those seeds)."""
    period = 310
    tasks = []
    for s in range(3):
        t0 = s * period
        # layer 0 waits for its slot until t0 + 100, then copies 100; layer 1 (final) copies 100 after it
        tasks.append(ReplayTask("q", 2 * s, s, 0, t0, (0, 0, 0, 100), ready_slot_ns=t0 + 100,
                                recorded_start_ns=t0, recorded_complete_ns=t0 + 200, run_id="r", cfg_label="c"))
        tasks.append(ReplayTask("q", 2 * s + 1, s, 1, t0, (0, 0, 0, 100), final_layer=True,
                                recorded_start_ns=t0 + 200, recorded_complete_ns=t0 + 300, run_id="r",
                                cfg_label="c"))
    add_dispatch_gaps(tasks)
    run = replay_run(tasks, policies=["ready_queue"], dispatch_ns={"ready_queue": 50})
    assert ttft(run, "fifo") == [300, 300, 300]
    # step 0: layer 0's 50 is absorbed by its slot wait, layer 1's is not: 350; every later step alike
    # (old model: 350, 300, 300: the slot found free 50 ns after the shifted arrival)
    assert ttft(run, "ready_queue") == [350, 350, 350]
    (per,) = run.replays.values()
    rep = per["ready_queue"]
    assert rep.rl[2] - rep.arrays.rl[2] == 50 and rep.rl[4] - rep.arrays.rl[4] == 100
    assert check_constraints(rep) == []
