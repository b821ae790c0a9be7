"""What one ``get()`` decision does: the rule pass before any probe, per-step counts kept by put/get
(not recounted per get) that stay right when tasks leave out of order."""

from __future__ import annotations

from otel_kvtrace.schedule import rules
from otel_kvtrace.schedule.queue import SchedulingQueue, hook_save_signals

from .fakes import FakeThread, Task


def make() -> tuple[SchedulingQueue, FakeThread]:
    thread = FakeThread()
    q = SchedulingQueue(thread, "ready_queue")
    hook_save_signals(q, thread.layer_save_finished_events)
    return q, thread


def test_head_goes_after_one_probe_when_the_rules_let_no_task_pass() -> None:
    q, th = make()
    th.layer_save_finished_events[1].set()
    th.sync_save_events[1].done = False  # the head waits on the device only
    q.put(Task(6, wait_for_save_layer=1))
    q.put(Task(7))  # final layer, not alone in its step: final_last keeps it behind the head
    assert q.try_get().layer_id == 6
    assert th.sync_save_events[1].queries == 1  # the head's probe, not repeated by a probe pass
    assert q.blocked_by[rules.FINAL_LAST] == 1 and q.bypassed == 0


def test_step_counts_follow_out_of_order_gets() -> None:
    """The final layer of step 2 may pass step 1's waiting head once it is the last unserved task of its
    step; that needs the count of step 2 to drop when its other task leaves by a bypass."""
    q, _ = make()
    q.put(Task(5, wait_for_save_layer=1))  # step 1, waits on a save that never comes here
    q.put(Task(6))  # step 1
    q.put(Task(2))  # step 2 (layer ids restart)
    q.put(Task(7))  # step 2, final layer
    assert [q.try_get().layer_id for _ in range(3)] == [6, 2, 7]
    assert q.bypassed == 3
    assert q.try_get().layer_id == 5  # alone: handed out to block in its own wait


def test_a_head_alone_goes_without_a_probe() -> None:
    q, th = make()
    th.layer_save_finished_events[1].set()
    th.sync_save_events[1].done = False
    q.put(Task(6, wait_for_save_layer=1))
    assert q.try_get().layer_id == 6
    assert th.sync_save_events[1].queries == 0  # nothing could go instead: FIFO's cost


class _LockCheckingEvent:
    """An NPU event that records whether the queue's lock was held when it was queried."""

    def __init__(self, q: SchedulingQueue, done: bool) -> None:
        self.q, self.done, self.under_lock = q, done, []

    def query(self) -> bool:
        self.under_lock.append(self.q.mutex.locked())
        return self.done

    def synchronize(self) -> None:
        raise AssertionError("never synchronized by the scheduler")


def test_no_npu_query_runs_under_the_queue_lock() -> None:
    """A driver call under the lock would make every producer's put and save set wait on it: the head's
    fast-path probe (ready and not ready) and the candidates' probes all run with the lock released."""
    for head_done in (True, False):
        q, th = make()
        for layer in (1, 2):
            th.layer_save_finished_events[layer].set()
        head_event, cand_event = _LockCheckingEvent(q, head_done), _LockCheckingEvent(q, True)
        th.sync_save_events[1], th.sync_save_events[2] = head_event, cand_event  # type: ignore[call-overload]
        q.put(Task(5, wait_for_save_layer=1))
        q.put(Task(6, wait_for_save_layer=2))
        q.put(Task(7))
        assert q.try_get().layer_id == (5 if head_done else 6)
        assert head_event.under_lock and not any(head_event.under_lock), head_done
        assert not any(cand_event.under_lock)
