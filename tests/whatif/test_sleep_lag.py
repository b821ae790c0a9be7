"""A ``ready_queue`` thread sleeping in ``get()`` until a wait is met pays that wait's wake-up latency
(a model fix; docs/whatif.md "Fidelity").

The old replay woke the sleeping thread exactly at the dependency time, while FIFO (blocked in the
task's own wait) paid the recorded wake-up latency: where both policies do the same thing, sleep until a
save, ``ready_queue`` was predicted faster by that latency (50-130 us per step in ``hol`` and
``upstream``, once or twice a step). Live, the save's ``set()`` notifies the queue's condition as it sets
the event a blocked FIFO head waits on; the woken thread then decides and dequeues (the loop before
``get()``, the recorded dispatch gap, ran before it slept).
"""

from __future__ import annotations

from otel_kvtrace.whatif.engine import QueueArrays, replay_queue
from otel_kvtrace.whatif.metrics import check_constraints
from otel_kvtrace.whatif.policy import get_policy
from otel_kvtrace.whatif.task import ReplayTask


def tasks(*, wake: int = 40, gap: int = 10) -> list[ReplayTask]:
    # 0: save ready at 100, recorded to wake 40 after it, dispatch gap ``gap`` (all its w0), 10 of copy;
    # 1: save ready at 300 (cannot pass at first); 2: final layer
    return [
        ReplayTask("q", 0, 0, 1, 0, (gap, 10, 0, 0), ready_save_ns=100, wait_for_save_layer=0,
                   wake_ns=(wake, 0, 0), dispatch_gap_ns=gap),
        ReplayTask("q", 1, 0, 2, 0, (0, 10, 0, 0), ready_save_ns=300, wait_for_save_layer=0),
        ReplayTask("q", 2, 0, 7, 0, (0, 0, 0, 10), final_layer=True),
    ]


def run(ts: list[ReplayTask], policy: str):  # type: ignore[no-untyped-def]
    return replay_queue(QueueArrays.from_tasks(ts), get_policy(policy))


def test_sleeping_until_a_save_costs_what_blocking_in_it_costs() -> None:
    fifo = run(tasks(), "fifo")
    assert fifo.complete[0] == 150  # 0-10 its loop, blocked in the save wait until 100 + 40, copy 140-150
    rq = run(tasks(), "ready_queue")
    # nothing ready at 0: the thread sleeps in get(); woken 40 after the save, its loop (10) ran before
    # the sleep: 0 starts at 130 and completes at 150, as FIFO. The old replay woke it at 100: 120.
    assert rq.start[0] == 130 and rq.complete[0] == 150
    assert check_constraints(rq) == []


def test_a_task_whose_own_wait_never_blocked_gets_the_queue_s_typical_latency() -> None:
    ts = tasks()
    ts[1].wake_ns = (0, 0, 0)  # its own save wait did not block in the recording
    # one more task that could pass 1 but is not ready before 400: the thread sleeps in get() at 150
    ts.insert(2, ReplayTask("q", 2, 0, 3, 0, (0, 10, 0, 0), ready_save_ns=400, wait_for_save_layer=0))
    ts[3] = ReplayTask("q", 3, 0, 7, 0, (0, 0, 0, 10), final_layer=True)
    ts.append(ReplayTask("q", 4, 1, 1, 1000, (0, 10, 0, 0), ready_save_ns=1100, wait_for_save_layer=0,
                         wake_ns=(60, 0, 0)))
    ts.append(ReplayTask("q", 5, 1, 7, 1000, (0, 0, 0, 10), final_layer=True))
    q = QueueArrays.from_tasks(ts)
    assert q.typical_wake == (60, 0, 0)  # median of the blocked waits' latencies (40, 60)
    rq = replay_queue(q, get_policy("ready_queue"))
    assert rq.start[1] == 300 + 60  # woken the typical save latency after its save
    assert check_constraints(rq) == []
