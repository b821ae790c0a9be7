"""The send thread's copy, woken behind the recv thread's GIL hold (``whatif/gil.py``, second part).

Found on the real 0.23.0.post1 recv thread (``bench/whatif_fidelity.py``, kept traces of 2026-12-06): the
send thread sleeps in each save's copy and then needs the GIL; under FIFO the recv thread often ran Python
right then, under ``ready_queue`` it slept in its own copy, so saves 3-5 ended 9-37 us sooner live, and
layer 7 (behind the save of layer 5) with them, which the replay of recorded save services missed.
"""

from __future__ import annotations

from types import SimpleNamespace

from otel_kvtrace.whatif import gil
from otel_kvtrace.whatif.columns import NONE, QueueArrays
from otel_kvtrace.whatif.engine import replay_queue
from otel_kvtrace.whatif.policy import get_policy
from otel_kvtrace.whatif.saves import SaveTask
from otel_kvtrace.whatif.task import ReplayTask
from tests.whatif.fixtures import U, three_loads_behind_a_save



def test_the_recv_thread_holds_the_gil_through_its_work_but_not_its_copy_or_a_blocking_wait() -> None:
    # dispatch+build 10, gate wait blocks 10 -> 100, then 50 of work with the copy (sleep) at 20-50 of the
    # work offsets, then 40 of completion
    task = ReplayTask("q", 0, 0, 0, 0, (10, 0, 50, 40), ready_gate_ns=100, copy_at_ns=20, backend_submit_ns=30)
    rep = replay_queue(QueueArrays.from_tasks([task]), get_policy("fifo"))
    assert rep.complete == [190]
    assert gil.recv_busy(rep, "copy") == [(0, 10), (100, 110), (140, 190)]
    # the policy's cost per dequeue is run before the task's work (the decision), when another task is
    # queued: the second one, handed out alone, pays none; runs that touch are one
    rep = replay_queue(QueueArrays.from_tasks([task, ReplayTask("q", 1, 0, 1, 0, (0, 0, 0, 10))]),
                       get_policy("fifo"), decision_ns=5)
    assert rep.dispatched == [5, 0]
    assert gil.recv_busy(rep, "copy") == [(0, 15), (100, 110), (140, 200)]


def test_a_wait_met_while_the_policy_decided_does_not_end_the_run() -> None:
    # the save is met at 12; the task reaches its wait at 5 (the decision, another task being queued) + 10
    task = ReplayTask("q", 0, 0, 0, 0, (10, 20, 0, 0), ready_save_ns=12)
    rep = replay_queue(QueueArrays.from_tasks([task, ReplayTask("q", 1, 0, 1, 0, (0, 0, 0, 10))]),
                       get_policy("fifo"), decision_ns=5)
    assert rep.dispatched == [5, 0] and rep.complete[0] == 35
    assert gil._run_into(rep, 0, [-1, -1]) == 30  # all of its work: no wait blocked
    assert gil._run_into(rep, 0, [18, -1]) == 18  # ... up to a release point


def _two_saves() -> tuple[QueueArrays, list[ReplayTask]]:
    """One step: loads of layers 0-2, layer 2 waits on the save of layer 1; the two saves' copies are
    recorded (save 1: copy 1600-2590 us, its 90 us past the copy are the tail after the GIL came back)."""
    tasks = three_loads_behind_a_save()
    saves = [SaveTask(0, 0, 110 * U, 1500 * U, 120 * U, 310 * U, 400 * U, 1400 * U),
             SaveTask(0, 1, 210 * U, 2600 * U, 1510 * U, 1511 * U, 1600 * U, 2590 * U)]
    return QueueArrays.from_tasks(tasks, saves), tasks


def test_a_copy_waits_for_the_rest_of_the_recv_run_in_progress_at_its_wake_up() -> None:
    q, _ = _two_saves()
    rep = replay_queue(q, get_policy("fifo"))
    assert rep.send_post is not None and rep.send_post[0] == [310 * U, 1510 * U]  # after the device point
    model = gil.SendModel(wake=[900 * U, 900 * U], tail_ns=90 * U, points=1)
    # save 1's copy starts at 1600 (1510 + 90): it wakes at 2500, inside a recv run 2450-2530 -> waits 30
    waits = gil.copy_waits(rep, [(0, 90 * U), (2450 * U, 2530 * U)], model)
    assert waits == {(0, 0): 0, (0, 1): 30 * U}
    # on another timeline the run ends before the wake-up: no wait; the save's work is 30 us shorter
    other = gil.copy_waits(rep, [(2400 * U, 2480 * U)], model)
    assert gil.save_extra(rep, waits, other) == [[0, -30 * U]]
    # ... and so is the load behind it (layer 2 waits on the save of layer 1)
    moved = replay_queue(q, get_policy("fifo"), save_extra_ns=[[0, -30 * U]])
    assert moved.complete[2] == rep.complete[2] - 30 * U


def test_the_model_is_sized_from_fifo_copies_a_recv_run_ended_in() -> None:
    # 40 steps, one save each: copies of 500 us at 0, 1000, 2000 ...; in every other step a recv run
    # ends 450 us into the copy and the copy then ends 50 us later (uncontended copies: 480 us long)
    send = [[(0, 0, -1, NONE, 600, 0, 0, 480 * U if s % 2 else 500 * U)] for s in range(40)]
    fifo = SimpleNamespace(arrays=SimpleNamespace(send=send), send_post=[[s * 1000 * U] for s in range(40)])
    busy = [(s * 1000 * U + 300 * U, s * 1000 * U + 450 * U) for s in range(0, 40, 2)]
    assert gil.fit_send(fifo, busy) is None  # 20 copies a run ended in: fewer than MIN_POINTS
    busy = [(s * 1000 * U + 300 * U, s * 1000 * U + 450 * U) for s in range(40) if s % 2 == 0 or s < 21]
    model = gil.fit_send(fifo, busy)
    assert model is not None and model.points == 30
    # runs that ended in the odd (480 us) copies: 30 us before their end; in the even ones 50 us
    assert model.tail_ns == 50 * U  # the median of 20 x 50 and 10 x 30 us
    assert model.wake == [480 * U - model.tail_ns]  # the uncontended copy (10th percentile) less the tail


def test_a_policy_replay_gets_its_own_copy_waits_minus_fifo_s() -> None:
    """``replay_policy``'s third pass (what ``replay_run`` runs per policy): the copy waits on the policy's
    own replayed timeline minus those on FIFO's, added to each save; the loads behind it move."""
    q, _ = _two_saves()
    fifo = replay_queue(q, get_policy("fifo"), shift_steps=False)
    policy = get_policy("ready_queue")
    kw = {"feedback": "full", "reference": [e[-1] for e in fifo.fwd_end]}
    plain = gil.replay_policy(q, policy, None, **kw)
    model = gil.SendModel(wake=[900 * U, 900 * U], tail_ns=90 * U, points=30)
    # FIFO's copy of save 1 waited 30 us behind the recv thread; on the policy's timeline the recv thread
    # is idle then (it waits for that very save), so the save, and layer 2 behind it, end 30 us sooner
    assert gil.copy_waits(plain, gil.recv_busy(plain, "copy"), model)[(0, 1)] == 0
    coupling = gil.Coupling(None, "copy", gil.release_points(q, "copy"), [], model, {(0, 0): 0, (0, 1): 30 * U})
    coupled = gil.replay_policy(q, policy, coupling, **kw)
    assert coupled.complete[2] == plain.complete[2] - 30 * U
    assert coupled.complete[:2] == plain.complete[:2]
    # without a send model (too few FIFO copies a recv run ended in), nothing changes
    fitted = gil.Coupling.fit(q, fifo)
    assert fitted.send is None and gil.replay_policy(q, policy, fitted, **kw).complete == plain.complete
