"""The live ready_queue probes with the queue lock released; what changes meanwhile is re-checked under
it. One thread, deterministic: the probed NPU event itself switches the policy or takes tasks, as
another thread could while the lock is free."""

from __future__ import annotations

import queue
from collections.abc import Callable

import pytest

from otel_kvtrace.schedule.queue import SchedulingQueue

from .fakes import FakeNpuEvent, FakeThread, Task


class _MeanwhileEvent(FakeNpuEvent):
    """Its first query runs ``meanwhile`` first (what another thread does during it)."""

    def __init__(self, done: bool, meanwhile: Callable[[], None]) -> None:
        super().__init__(done=done)
        self.meanwhile = meanwhile

    def query(self) -> bool:
        if not self.queries:
            self.meanwhile()
        return super().query()


def _queue(at: int, meanwhile: Callable[[SchedulingQueue], None]) -> SchedulingQueue:
    """Head 5 waits on an incomplete save sync event; 6 (a ready save) and 7 (no waits) may pass it.
    ``meanwhile`` runs during the ``at``-th probe: 1 = the head's (its save sync event), 2 = the first
    candidate's (6's complete save sync event); 0 = never."""
    thread = FakeThread(num_layers=16)  # 7 is not the final layer: it may pass a waiting head too
    q = SchedulingQueue(thread, "ready_queue")
    for layer in (1, 2):
        thread.layer_save_finished_events[layer].set()
    thread.sync_save_events[1] = _MeanwhileEvent(False, lambda: meanwhile(q) if at == 1 else None)
    thread.sync_save_events[2] = _MeanwhileEvent(True, lambda: meanwhile(q) if at == 2 else None)
    for task in (Task(5, wait_for_save_layer=1), Task(6, wait_for_save_layer=2), Task(7)):
        q.put(task)
    return q


def _take_head(q: SchedulingQueue) -> None:
    q._take(0)  # another consumer's get (the lock is free)


def _take_all(q: SchedulingQueue) -> None:
    while q.queue:
        q._take(0)


def test_without_a_change_the_ready_task_passes_the_waiting_head() -> None:
    q = _queue(at=0, meanwhile=lambda q: None)
    assert (q.get(block=False).layer_id, q.bypassed) == (6, 1)


@pytest.mark.parametrize("at", [1, 2], ids=["head probe", "candidate probe"])
def test_a_switch_to_fifo_during_a_probe_hands_out_the_head(at: int) -> None:
    q = _queue(at, lambda q: q.set_policy("fifo"))
    assert (q.get(block=False).layer_id, q.bypassed) == (5, 0)


@pytest.mark.parametrize("at", [1, 2], ids=["head probe", "candidate probe"])
def test_a_head_taken_during_a_probe_makes_it_decide_again(at: int) -> None:
    q = _queue(at, _take_head)
    assert q.get(block=False).layer_id == 6  # the new head, ready: not a stale index into the old queue
    assert [e.item.layer_id for e in q.queue] == [7]


def test_a_non_blocking_get_on_a_queue_emptied_during_the_probe_raises_empty() -> None:
    q = _queue(1, _take_all)
    with pytest.raises(queue.Empty):
        q.get(block=False)
