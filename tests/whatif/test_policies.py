"""Each policy on hand-built schedules whose optimal order and times are worked out by hand."""

from __future__ import annotations

import pytest

from otel_kvtrace.whatif.engine import QueueArrays, ReplayStalled, replay_queue
from otel_kvtrace.whatif.metrics import check_constraints, hol_events
from otel_kvtrace.whatif.policy import INF, Policy, get_policy, policy_names
from otel_kvtrace.whatif.task import ReplayTask


def task(seq: int, layer: int, *, arrival: int = 0, work: int = 10, step: int = 0, **kw: object) -> ReplayTask:
    """A task whose whole service is copy work after its waits (work[3])."""
    return ReplayTask("q", seq, step, layer, arrival, (0, 0, 0, work), **kw)  # type: ignore[arg-type]


def run(tasks: list[ReplayTask], policy: str, **kw: str):
    rep = replay_queue(QueueArrays.from_tasks(tasks), get_policy(policy), **kw)
    assert check_constraints(rep) == []
    return rep


def order(rep) -> list[int]:
    """Seqs in the order their copies ran (the copy point follows every wait)."""
    return [rep.arrays.tasks[i].seq for i in sorted(range(rep.arrays.n), key=lambda i: (rep.passed[i], i))]


def test_registry_lists_the_three_policies_fifo_first() -> None:
    assert policy_names()[:1] == ["fifo"]
    assert {"fifo", "ready_queue", "gate_group"} <= set(policy_names())


def test_unknown_policy_names_the_option() -> None:
    with pytest.raises(ValueError, match="policy: unknown 'lifo'"):
        get_policy("lifo")


def test_fifo_blocks_behind_a_waiting_head() -> None:
    # head waits for its save until t=100; the task behind it is ready at 0
    tasks = [task(0, 3, ready_save_ns=100, wait_for_save_layer=1), task(1, 4), task(2, 7, final_layer=True)]
    rep = run(tasks, "fifo")
    assert order(rep) == [0, 1, 2]
    assert rep.complete == [110, 120, 130]
    hol = hol_events(rep)
    assert [(h.seq, h.duration_ns, h.evidence_seq) for h in hol] == [(0, 100, 1)]


def test_hol_counts_only_tasks_of_the_head_s_own_step() -> None:
    # step 0: layer 3 waits for its gate until t=100; the final layer 7 is behind it. Step 1's layer 1
    # arrives at 10 with no dependency: it is ready behind the head but belongs to the next step, so
    # it is not HOL (the SQL partitions by queue and step the same way). Step 0's layer 4 is, from 40.
    tasks = [task(0, 3, ready_gate_ns=100, gate_id=1), task(1, 7, final_layer=True),
             task(2, 1, step=1, arrival=10)]
    rep = run(tasks, "fifo")
    assert order(rep) == [0, 1, 2]
    assert hol_events(rep) == []
    tasks = [task(0, 3, ready_gate_ns=100, gate_id=1), task(1, 4, arrival=40),
             task(2, 7, arrival=40, final_layer=True), task(3, 1, step=1, arrival=50)]
    hol = hol_events(run(tasks, "fifo"))
    assert [(h.seq, h.duration_ns, h.evidence_seq) for h in hol] == [(0, 60, 1)]


def test_ready_queue_hands_out_whole_tasks_as_the_live_queue() -> None:
    """The live ``get()`` hands out a task whole: the head's work before its wait is never run early and
    set aside (the replay's earlier cooperative model did: busy (0, 30), (30, 50), (100, 110), which
    under-predicted the live gain on the real 0.23 recv thread)."""
    # task 0: 30 of metadata work, then a gate at 100, then 10 of copy; task 1: 20 of work, no deps
    tasks = [
        ReplayTask("q", 0, 0, 1, 0, (30, 0, 0, 10), ready_gate_ns=100, gate_id=0),
        ReplayTask("q", 1, 0, 2, 0, (20, 0, 0, 0)),
    ]
    fifo = run(tasks, "fifo")
    assert fifo.complete == [110, 130]
    rep = run(tasks, "ready_queue")
    # 1 is ready and goes whole 0-20; 0 then builds 20-50, blocks in its gate wait, copies 100-110
    assert rep.busy == [(0, 20), (20, 110)]
    assert rep.complete == [110, 20]


def test_ready_queue_lets_the_ready_task_go_first() -> None:
    tasks = [task(0, 3, ready_save_ns=100, wait_for_save_layer=1), task(1, 4), task(2, 7, final_layer=True)]
    rep = run(tasks, "ready_queue")
    # 1 runs 0-10 while 0 waits; 0 runs 100-110; the final task goes last: 110-120
    assert order(rep) == [1, 0, 2]
    assert rep.complete == [110, 10, 120]


def test_ready_queue_keeps_the_final_layer_task_last_even_when_it_is_ready_first() -> None:
    tasks = [task(0, 1, ready_gate_ns=50, gate_id=0), task(1, 7, final_layer=True)]
    rep = run(tasks, "ready_queue")
    assert order(rep) == [0, 1]
    assert rep.complete == [60, 70]


def test_ready_queue_picks_lowest_seq_among_ready_and_sleeps_until_first_readiness() -> None:
    # saves (host signals): nothing ready until 30; then 1 (lowest ready seq) 30-40; at 40 0 is ready
    tasks = [
        task(0, 1, ready_save_ns=40, wait_for_save_layer=0),
        task(1, 2, ready_save_ns=30, wait_for_save_layer=0),
        task(2, 3, ready_save_ns=30, wait_for_save_layer=0),
    ]
    rep = run(tasks, "ready_queue")
    assert order(rep) == [1, 0, 2]
    assert rep.passed == [40, 30, 50]
    assert rep.complete == [50, 40, 60]


def test_ready_queue_hands_out_a_head_waiting_on_its_gate_when_nothing_is_ready() -> None:
    """A gate (device progress) has no host signal: with no other task ready the live queue hands the
    head out to block in its own wait; a task ready later waits behind it, as under FIFO."""
    tasks = [
        task(0, 1, ready_gate_ns=40, gate_id=0),
        task(1, 2, ready_gate_ns=30, gate_id=0),
        task(2, 3, ready_gate_ns=30, gate_id=0),
    ]
    rep = run(tasks, "ready_queue")
    assert order(rep) == [0, 1, 2]
    assert rep.complete == [50, 60, 70]


def test_ready_queue_never_lets_a_slot_chain_successor_pass_its_predecessor() -> None:
    # layer 3 reuses layer 1's slot: its save (recorded at 5) comes after the forward passed layer 1.
    # Layer 1 waits for its gate until 100; the save dependency of layer 3 must follow the replayed load.
    tasks = [
        task(0, 1, ready_gate_ns=100, gate_id=0, consumer_wait_start_ns=0, consumer_wait_end_ns=110,
             recorded_complete_ns=110),
        task(1, 3, ready_save_ns=115, wait_for_save_layer=1, recorded_complete_ns=125),
    ]
    for policy in ("fifo", "ready_queue", "gate_group"):
        rep = run(tasks, policy)
        assert rep.passed[1] >= rep.complete[0], policy


def test_forward_delay_moves_gated_dependencies_later() -> None:
    # Recorded: layer 1 loaded at 10, forward passed it at 10, gate G_1 recorded at 20 (10 later).
    # Replayed with layer 1 finishing at 60 (its slot is released late): G_1 opens at 70.
    tasks = [
        task(0, 1, ready_slot_ns=50, consumer_wait_start_ns=0, consumer_wait_end_ns=10, recorded_complete_ns=10),
        task(1, 2, ready_gate_ns=20, gate_id=1, recorded_complete_ns=30),
    ]
    rep = run(tasks, "fifo")
    assert rep.complete[0] == 60
    assert rep.eff_rg[1] == 70
    assert rep.complete[1] == 80
    slow = run(tasks, "fifo", feedback="delay_only")
    assert slow.complete[1] == 80


def test_feedback_full_moves_dependencies_earlier_delay_only_does_not() -> None:
    # Recorded: layer 1 finished late (forward passed at 100); G_1 recorded at 110. Replayed layer 1
    # finishes at 10 (no waits in the replay input): full feedback opens G_1 at 20, delay_only at 110.
    tasks = [
        task(0, 1, consumer_wait_start_ns=0, consumer_wait_end_ns=100, recorded_complete_ns=100),
        task(1, 2, ready_gate_ns=110, gate_id=1, recorded_complete_ns=120),
    ]
    assert run(tasks, "fifo").complete[1] == 30
    assert run(tasks, "fifo", feedback="delay_only").complete[1] == 120
    with pytest.raises(ValueError, match="feedback"):
        replay_queue(QueueArrays.from_tasks(tasks), get_policy("fifo"), feedback="sometimes")


def _gate_batch_tasks() -> list[ReplayTask]:
    # backend time = 30 + bytes/10: the fitted per-call overhead is 30 ns
    def t(seq: int, layer: int, nbytes: int, **kw: object) -> ReplayTask:
        sub = 30 + nbytes // 10
        return ReplayTask("q", seq, 0, layer, 0, (0, 0, 0, sub), backend_submit_ns=sub, bytes=nbytes,
                          **kw)  # type: ignore[arg-type]

    return [
        t(0, 0, 100),  # no gate: alone, 0-40
        t(1, 1, 200, ready_gate_ns=100, gate_id=0),  # G_0 opens at 100
        t(2, 2, 300, ready_gate_ns=100, gate_id=0),
        t(3, 3, 400, ready_gate_ns=100, gate_id=0),
        t(4, 7, 100, final_layer=True, ready_gate_ns=100, gate_id=0),  # final: never batched
    ]


def test_gate_group_serves_tasks_sharing_a_gate_as_one_call() -> None:
    tasks = _gate_batch_tasks()
    q = QueueArrays.from_tasks(tasks)
    assert q.call_overhead_ns == 30
    fifo = run(tasks, "fifo")
    assert fifo.complete == [40, 150, 210, 280, 320]
    rep = run(tasks, "gate_group")
    # the head is handed out at 40 and blocks in its gate wait; at 100 it claims 2 and 3: work 50+60+70
    # minus two calls (60) = 120 -> all done at 220; then final 220-260
    assert rep.start[1] == 40 and rep.start[2] == rep.start[3] == 100
    assert rep.complete[1:4] == [220, 220, 220]
    assert rep.complete[4] == 260
    assert rep.batches == 1


def test_gate_group_without_shared_gates_is_fifo() -> None:
    tasks = [task(0, 1, ready_gate_ns=5, gate_id=0), task(1, 2, ready_gate_ns=9, gate_id=1), task(2, 3)]
    assert run(tasks, "gate_group").complete == run(tasks, "fifo").complete


def test_arrivals_are_respected_and_idle_time_skipped() -> None:
    tasks = [task(0, 0, arrival=0), task(1, 1, arrival=1000), task(2, 2, arrival=1001)]
    for policy in policy_names():
        rep = run(tasks, policy)
        assert rep.start == [0, 1000, 1010], policy


def test_a_fourth_policy_registers_by_subclassing_alone() -> None:
    class LastFirst(Policy):
        """Serve the newest arrived task (no constraints kept: only for the registry test)."""

        name = "test_last_first"

        def select(self, state, now):  # type: ignore[no-untyped-def]
            for i in range(state.n_arrived - 1, -1, -1):
                if not state.served[i]:
                    return [i]
            return INF

    try:
        assert "test_last_first" in policy_names()
        tasks = [task(0, 0), task(1, 1), task(2, 2)]
        rep = replay_queue(QueueArrays.from_tasks(tasks), get_policy("test_last_first"))
        assert order(rep) == [2, 1, 0]
    finally:
        Policy._registry.pop("test_last_first", None)


def test_a_policy_that_waits_forever_is_reported() -> None:
    class Sleeper(Policy):
        name = "test_sleeper"

        def select(self, state, now):  # type: ignore[no-untyped-def]
            return INF

    try:
        with pytest.raises(ReplayStalled, match="test_sleeper"):
            replay_queue(QueueArrays.from_tasks([task(0, 0)]), get_policy("test_sleeper"))
    finally:
        Policy._registry.pop("test_sleeper", None)
