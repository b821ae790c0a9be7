"""The live ``ready_queue``'s cost per dequeue, sized from the FIFO recording (``whatif/decision.py``), and
the in-order layers the A/B report reads the live policy's remaining cost from (docs/whatif.md, "Replay
model", "A policy's own cost per dequeue").

Before: the prediction charged 0 per dequeue, and on every layer it did not reorder the live
``ready_queue`` was 15-23 us later than FIFO (the head's readiness probe in ``get()``, run while the woken
forward waits for the GIL). A FIFO recording times those checks in situ: the waits that did not block.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from otel_kvtrace.whatif.decision import check_medians, decision_cost_ns
from otel_kvtrace.whatif.replay import _after_first_reorder, replay_run
from otel_kvtrace.whatif.task import ReplayTask, task_from_row

U = 1000  # ns per us


def _row(seq: int, layer: int, t0: int, *, save: tuple[int, int] | None = None, save_dep: int | None = None,
         gate: tuple[int, int] | None = None, gate_dep: int | None = None) -> dict[str, Any]:
    """A ``tasks`` row dequeued at ``t0`` us, completed 100 us later, with optional wait stages (us)."""
    row: dict[str, Any] = {"queue": "w0/recv", "seq": seq, "step": 1, "layer_id": layer, "ts_enqueue": 0,
                           "ts_dequeue": t0 * U, "ts_complete": (t0 + 100) * U, "run_id": "r1"}
    if save is not None:
        row |= {"save_cpu_wait_start": save[0] * U, "save_cpu_wait_end": save[1] * U, "ts_dep_save_cpu": save_dep}
    if gate is not None:
        row |= {"gate_cond_wait_start": gate[0] * U, "gate_cond_wait_end": gate[1] * U,
                "ts_dep_gate_record": gate_dep}
    return row


def test_a_wait_that_did_not_block_times_the_check_and_one_that_blocked_does_not() -> None:
    met = task_from_row(_row(0, 0, 0, save=(10, 13), save_dep=5 * U, gate=(20, 24), gate_dep=1 * U))
    blocked = task_from_row(_row(1, 1, 200, save=(210, 400), save_dep=390 * U, gate=(410, 415), gate_dep=100 * U))
    unknown = task_from_row(_row(2, 2, 500, save=(510, 512)))  # no dependency time: met or not is unknown
    assert met.check_ns == (3 * U, 4 * U, None)
    assert blocked.check_ns == (-1, 5 * U, None)
    assert unknown.check_ns == (-1, None, None)
    # per kind the median over the waits that did not block; per task the sum over the kinds it has
    assert check_medians([met, blocked, unknown]) == [3 * U, 4500, None]
    assert decision_cost_ns([met, blocked, unknown]) == 7500  # median of 7.5, 7.5 and 3 us
    assert decision_cost_ns([ReplayTask("q", 0, 0, 0, 0)]) == 0  # nothing recorded: nothing charged


def test_replay_charges_it_to_the_policy_that_probes_the_head_only() -> None:
    rows = [_row(i, i, i * 100, save=(i * 100 + 10, i * 100 + 16), save_dep=0, gate=(i * 100 + 20, i * 100 + 22),
                 gate_dep=0) for i in range(4)]
    tasks = [task_from_row(r) for r in rows]
    run = replay_run(tasks, policies=["ready_queue", "gate_group"])
    (queue,) = run.decision_ns
    assert run.decision_ns[queue] == 8 * U  # 6 + 2 us
    per = run.replays[queue]
    assert (per["fifo"].dispatched, per["gate_group"].dispatched) == ([0] * 4, [0] * 4)
    # every load is later by the decision's cost per dequeue under ready_queue (nothing to reorder), paid
    # while another task is queued: not by the last one, which the live queue hands out unprobed
    assert [b - a for a, b in zip(per["fifo"].complete, per["ready_queue"].complete, strict=True)] \
        == [8 * U, 16 * U, 24 * U, 24 * U]
    assert per["ready_queue"].dispatched == [8 * U, 8 * U, 8 * U, 0]
    # an explicit cost wins, on every dequeue (the A/B report's calibrated column: measured as an average
    # over every busy dequeue; the sensitivity bench)
    run = replay_run(tasks, policies=["ready_queue"], dispatch_ns={"ready_queue": 0})
    assert run.replays[queue]["ready_queue"].complete == run.replays[queue]["fifo"].complete
    run = replay_run(tasks, policies=["ready_queue"], dispatch_ns={"ready_queue": 3 * U})
    assert run.replays[queue]["ready_queue"].dispatched == [3 * U] * 4


def test_in_order_layers_end_at_the_first_task_a_later_one_started_before_or_with() -> None:
    rep = SimpleNamespace(start=[0, 10, 50, 30, 60, 70], merged=None)
    assert _after_first_reorder(rep, [0, 1, 2, 3, 4, 5]) == [2, 3, 4, 5]  # 3 started before 2
    rep = SimpleNamespace(start=[0, 10, 20], merged=None)
    assert _after_first_reorder(rep, [0, 1, 2]) == []


def test_a_merged_gate_group_batch_is_not_in_order() -> None:
    """The engine starts a batch's head at its dequeue and the members later, when claimed: in start
    order, but merged into one copy (found in review: every layer of ``hol``'s gate_group was marked in
    order, so its in-order excess averaged the merged layers' +1 ms too)."""
    def t(seq: int, layer: int, work: tuple[int, int, int, int], **kw: Any) -> ReplayTask:
        return ReplayTask("q", seq, 0, layer, 0, work, backend_submit_ns=10, bytes=100, **kw)

    tasks = [t(0, 0, (0, 0, 0, 40)), t(1, 1, (50, 0, 0, 60), ready_gate_ns=100, gate_id=0),
             t(2, 2, (20, 0, 0, 60), ready_gate_ns=100, gate_id=0, dispatch_gap_ns=20),
             t(3, 7, (0, 0, 0, 10), ready_gate_ns=100, gate_id=0, final_layer=True)]
    run = replay_run(tasks, policies=["gate_group"])
    (per,) = run.replays.values()
    assert per["gate_group"].start[1] < per["gate_group"].start[2]  # the batch: head, then its member
    assert per["gate_group"].merged == [False, True, True, False]
    assert run.layer_profile("gate_group")["in_order"] == [1.0, 0.0, 0.0, 0.0]
    assert run.layer_profile("fifo")["in_order"] == [1.0, 1.0, 1.0, 1.0]
