"""H2 on a slow-slot replica run: no policy copies before the slot release that was recorded.

The virtual-clock replica records exact slot-release times. In the ``slow_slot`` stress, layer 3's
slot is released 3 ms late; with 4 requests per step most of those waits find the slot already free
when FIFO reaches them, but a policy that serves the task earlier (``gate_group`` batches it with its
gate group) must still wait for the release.
"""

from __future__ import annotations

from otel_kvtrace.replica.simulate import simulate
from otel_kvtrace.whatif.engine import QueueArrays, replay_queue
from otel_kvtrace.whatif.metrics import check_constraints
from otel_kvtrace.whatif.policy import get_policy, policy_names
from otel_kvtrace.whatif.sweep import SweepCell, cell_config
from otel_kvtrace.whatif.task import group_by_queue, row_from_record, tasks_from_records

SLOW_SLOT = SweepCell(path="gva", prefetch_layers=4, num_shared_buffers=4, buffer_reuse=False,
                      independent_layers=(0,), requests_per_step=4, stress="slow_slot")


def test_no_policy_serves_a_copy_before_its_recorded_slot_release() -> None:
    for seed in range(3):
        result = simulate(cell_config(SLOW_SLOT, seed), run_id=f"slot-{seed}")
        rows = {(r["queue"], r["seq"]): r for r in (row_from_record(rec) for rec in result.recv)}
        released = [r for r in rows.values()
                    if r.get("ts_dep_slot_release") is not None
                    and r["ts_dep_slot_release"] > r["ts_enqueue"]]
        assert released, "the slow-slot run must record slot releases after the task's arrival"
        for queue, tasks in group_by_queue(tasks_from_records(result.recv)).items():
            arrays = QueueArrays.from_tasks(tasks)
            for name in policy_names():
                rep = replay_queue(arrays, get_policy(name))
                assert check_constraints(rep) == [], (seed, name)
                for i, task in enumerate(tasks):
                    release = rows[(queue, task.seq)].get("ts_dep_slot_release")
                    if release is not None:
                        assert rep.passed[i] + arrays.t0 >= release, (seed, name, task.seq, task.layer_id)


def test_the_checker_compares_with_the_recorded_release_not_the_replayed_one() -> None:
    """A replay input that lost the slot constraint is still caught by ``check_constraints``."""
    result = simulate(cell_config(SLOW_SLOT, 2), run_id="slot-lost")
    for tasks in group_by_queue(tasks_from_records(result.recv)).values():
        for t in tasks:
            t.ready_slot_ns = None  # the replay no longer knows the slot release
        rep = replay_queue(QueueArrays.from_tasks(tasks), get_policy("gate_group"))
        if any("slot (H2)" in p for p in check_constraints(rep)):
            return
    raise AssertionError("check_constraints did not see a copy before its recorded slot release")
