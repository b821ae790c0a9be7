"""Property: on random schedules, no policy ever violates a hard constraint, and every task is served once.

Schedules are built the way upstream enqueues them: per step, layers in increasing order, the
final-layer task last; a task's gate layer and save-source layer are lower than its own layer (and
their tasks were enqueued earlier); dependency, arrival and work times are random.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from otel_kvtrace.whatif.engine import NONE, QueueArrays, replay_queue
from otel_kvtrace.whatif.metrics import check_constraints
from otel_kvtrace.whatif.policy import get_policy, policy_names
from otel_kvtrace.whatif.task import ReplayTask

TIME = st.integers(min_value=0, max_value=500)


@st.composite
def schedules(draw: st.DrawFn) -> list[ReplayTask]:
    num_layers = draw(st.integers(min_value=2, max_value=8))
    steps = draw(st.integers(min_value=1, max_value=3))
    with_forward = draw(st.booleans())
    tasks: list[ReplayTask] = []
    clock = 0
    seq = 0
    for step in range(steps):
        layers = sorted(draw(st.sets(st.integers(0, num_layers - 2), max_size=num_layers - 1)))
        layers.append(num_layers - 1)
        for layer in layers:
            clock += draw(st.integers(0, 50))
            lower = [x for x in layers if x < layer]
            gate = draw(st.sampled_from([None, *lower])) if lower else None
            src = draw(st.sampled_from([None, *lower])) if lower else None
            work = (draw(TIME), draw(TIME), draw(TIME), draw(TIME))
            slot = clock + draw(TIME) * 4 if draw(st.booleans()) else None
            rec_complete = clock + draw(st.integers(0, 3000))
            cw_start = clock + draw(st.integers(0, 3000)) if with_forward else None
            cw_end = max(cw_start, rec_complete) if cw_start is not None else None
            tasks.append(ReplayTask(
                queue="q", seq=seq, step=step, layer_id=layer, arrival_ns=clock, work_ns=work,
                wake_ns=(draw(st.integers(0, 30)), draw(st.integers(0, 30)), draw(st.integers(0, 30))),
                ready_save_ns=clock + draw(TIME) * 4 if src is not None else None,
                ready_gate_ns=clock + draw(TIME) * 4 if gate is not None else None,
                ready_slot_ns=slot, recorded_slot_release_ns=slot,
                final_layer=layer == num_layers - 1, gate_id=gate, wait_for_save_layer=src,
                completion_ns=draw(st.integers(0, work[3])),
                backend_submit_ns=draw(st.integers(1, 300)), bytes=draw(st.integers(1, 10_000)),
                recorded_complete_ns=rec_complete, consumer_wait_start_ns=cw_start, consumer_wait_end_ns=cw_end,
            ))
            seq += 1
        clock += 4000  # next step starts after the forward finished this one
    return tasks


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedules(), st.sampled_from(["full", "delay_only"]))
def test_no_policy_violates_a_hard_constraint(tasks: list[ReplayTask], feedback: str) -> None:
    q = QueueArrays.from_tasks(tasks)
    for name in policy_names():
        rep = replay_queue(q, get_policy(name), feedback=feedback)
        assert NONE not in rep.complete, name
        assert check_constraints(rep) == [], name


@settings(max_examples=60, deadline=None)
@given(schedules())
def test_fifo_serves_in_seq_order_one_task_at_a_time(tasks: list[ReplayTask]) -> None:
    q = QueueArrays.from_tasks(tasks)
    fifo = replay_queue(q, get_policy("fifo"))
    starts = fifo.start
    assert all(starts[i] <= starts[i + 1] for i in range(len(starts) - 1))
    assert all(fifo.complete[i] <= fifo.start[i + 1] for i in range(len(starts) - 1))


def test_the_checker_catches_a_violation() -> None:
    """The property above could not fail if the checker never reported anything."""
    tasks = [
        ReplayTask("q", 0, 0, 1, 0, (0, 0, 0, 10), ready_gate_ns=100, gate_id=0),
        ReplayTask("q", 1, 0, 7, 0, (0, 0, 0, 10), final_layer=True),
    ]
    rep = replay_queue(QueueArrays.from_tasks(tasks), get_policy("fifo"))
    assert check_constraints(rep) == []
    rep.start[1] = 0  # final-layer task moved before the other one: H3 and overlap
    rep.passed[0] = 50  # copy before its gate
    problems = check_constraints(rep)
    assert any("H3" in p for p in problems)
    assert any("gate" in p for p in problems)
    rep.busy.append((rep.busy[0][0], rep.busy[0][1]))  # a second thing at the same time
    assert any("two things at once" in p for p in check_constraints(rep))


def test_the_checker_uses_the_recorded_slot_release() -> None:
    """A task whose replayed slot constraint was lost is still checked against the recorded release."""
    tasks = [ReplayTask("q", 0, 0, 1, 0, (0, 0, 0, 10), ready_slot_ns=None, recorded_slot_release_ns=100),
             ReplayTask("q", 1, 0, 7, 0, (0, 0, 0, 10), final_layer=True)]
    rep = replay_queue(QueueArrays.from_tasks(tasks), get_policy("fifo"))
    assert any("recorded slot (H2)" in p for p in check_constraints(rep))
