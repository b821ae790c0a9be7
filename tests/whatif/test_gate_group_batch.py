"""The replayed ``gate_group`` batch as the replica runs it live, and the send thread's NPU sync as a
wait on the device (model fixes; docs/whatif.md "Replay model", found comparing the replayed
``gate_group`` timeline with the live one on ``hol``, layer by layer).

Old model: the thread waited for the batch's gate idle, then ran every member's work, dispatch gaps
included, and set every event at once; live the head runs its pre-gate work (metadata build) while the
gate is pending, a member is claimed inside the head's task (no dispatch before its copy) and gets its
event after the thread's loop and ``get()`` hand it out again. And a save's recorded service was replayed
whole: its NPU sync took 1 us under FIFO, where the save was queued behind another one and the device
had finished, but 220 us live under ``gate_group``, served at once after its later issue.
"""

from __future__ import annotations

from otel_kvtrace.whatif.columns import QueueArrays
from otel_kvtrace.whatif.engine import QueueState, replay_queue
from otel_kvtrace.whatif.policy import get_policy
from otel_kvtrace.whatif.saves import SaveTask
from otel_kvtrace.whatif.task import ReplayTask
from tests.whatif.fixtures import three_loads_behind_a_save


def test_the_head_runs_into_its_gate_wait_and_members_get_their_events_after_a_dequeue() -> None:
    def t(seq: int, layer: int, work: tuple[int, int, int, int], **kw: object) -> ReplayTask:
        return ReplayTask("q", seq, 0, layer, 0, work, backend_submit_ns=10, bytes=100, **kw)  # type: ignore[arg-type]

    tasks = [
        t(0, 0, (0, 0, 0, 40)),  # no gate: 0-40
        t(1, 1, (50, 0, 0, 60), ready_gate_ns=100, gate_id=0),  # 50 of metadata build before its gate
        t(2, 2, (20, 0, 0, 60), ready_gate_ns=100, gate_id=0, dispatch_gap_ns=20),  # 20: its dispatch gap
        t(3, 7, (0, 0, 0, 10), ready_gate_ns=100, gate_id=0, final_layer=True),
    ]
    rep = replay_queue(QueueArrays.from_tasks(tasks), get_policy("gate_group"))
    # the head is handed out at 40, builds 40-90, waits for the gate to 100, claims 2, copies both 100-220
    # (no call overhead: bytes do not vary); 2's event after the thread's loop again (its 20 gap). The old
    # model waited idle to 100 and ran 50+20+60+60 after it: both events at 290.
    assert rep.start[1] == 40 and rep.start[2] == 100
    assert rep.complete[1:3] == [220, 240]
    assert rep.complete[3] == 250


def test_a_save_served_at_once_after_a_later_issue_waits_for_the_device() -> None:
    u = 1000  # times in us
    tasks = three_loads_behind_a_save()
    saves = [
        # served at once: its NPU sync blocked 190 us (the device 200 us after the issue)
        SaveTask(0, 0, 110 * u, 1500 * u, 120 * u, 310 * u),
        # queued behind it under FIFO: the device was done by its sync (1 us)
        SaveTask(0, 1, 210 * u, 2600 * u, 1510 * u, 1511 * u),
    ]
    q = QueueArrays.from_tasks(tasks, saves)
    state = QueueState(q, index=False)
    state.prog[0] = 2
    state.fwd_end[0][:2] = [100 * u, 2000 * u]  # a policy's forward passes layer 1 at 2000 instead of 200
    state.ready_at(2)
    # the save is issued at 2010 to an idle send thread; its NPU sync waits for the device to 2210, then
    # its copy (1090 as recorded, the 1 us sync included) ends at 3300. The old model replayed the recorded
    # service (1100) from 2010: 3110.
    assert state.eff_rs[2] == 3300 * u
    fifo = replay_queue(q, get_policy("fifo"))
    assert fifo.complete == [90 * u, 190 * u, 2700 * u]  # FIFO as recorded
