"""One case per rule of the live scheduler, with fake CPU/NPU events (deterministic: ``get(block=False)``)."""

from __future__ import annotations

import queue
import time

import pytest

from otel_kvtrace.schedule import rules
from otel_kvtrace.schedule.queue import SchedulingQueue, hook_save_signals

from .fakes import FakeGate, FakeThread, Task


def make(thread: FakeThread | None = None, policy: str = "ready_queue") -> tuple[SchedulingQueue, FakeThread]:
    thread = thread or FakeThread()
    q = SchedulingQueue(thread, policy)
    hook_save_signals(q, thread.layer_save_finished_events)
    return q, thread


def pick(q: SchedulingQueue) -> int | None:
    try:
        return q.get(block=False).layer_id
    except queue.Empty:
        return None


def test_ready_independent_task_passes_a_head_waiting_on_its_save() -> None:
    q, th = make()
    q.put(Task(3, wait_for_save_layer=1))
    q.put(Task(4))
    assert pick(q) == 4
    assert q.bypassed == 1
    assert pick(q) == 3  # alone now: handed out to block in its own (upstream) wait, as FIFO would


def test_fifo_never_reorders() -> None:
    q, _ = make(policy="fifo")
    q.put(Task(3, wait_for_save_layer=1))
    q.put(Task(4))
    assert pick(q) == 3


def test_same_chain_successor_never_goes_first_even_with_a_stale_save_event() -> None:
    q, th = make()
    q.put(Task(2, wait_for_save_layer=0))  # head waits on layer 0's save
    q.put(Task(4, wait_for_save_layer=2))  # writes the buffer layer 2 still has to be loaded into
    th.layer_save_finished_events[2].set()  # stale: set, but layer 2 was not loaded this step
    assert pick(q) == 2  # 4 may not pass: the waiting head is handed out (blocks in its own wait)
    assert q.blocked_by[rules.BUFFER_CHAIN] >= 1 and q.bypassed == 0


def test_gate_boundary_not_recorded_or_not_complete_is_not_passed() -> None:
    q, _ = make()
    gate = FakeGate()
    q.put(Task(3, wait_for_save_layer=1))
    q.put(Task(4, attention_start_gate=gate))
    assert pick(q) is None  # gate not recorded
    gate.record(done=False)
    assert pick(q) is None  # recorded, device not there yet
    assert gate._event is not None and gate._event.syncs == 0  # never synchronized while not known complete
    gate._event.done = True
    assert pick(q) == 4


def test_final_layer_stays_last_of_its_step() -> None:
    q, th = make(FakeThread(num_layers=4))
    q.put(Task(2, wait_for_save_layer=0))
    q.put(Task(3))  # final layer, ready
    assert [pick(q), pick(q)] == [2, 3]  # never before the rest of its step
    assert q.blocked_by[rules.FINAL_LAST] >= 1 and q.bypassed == 0


def test_npu_event_completing_after_the_cpu_event_is_set() -> None:
    q, th = make()
    q.put(Task(3, wait_for_save_layer=1))
    q.put(Task(5, wait_for_save_layer=2))
    q.put(Task(6))
    th.layer_save_finished_events[2].set()
    th.sync_save_events[2].done = False  # CPU event set, D2H not finished on the device
    assert pick(q) == 6  # 5 is not ready yet: the later independent one goes
    assert th.sync_save_events[2].syncs == 0
    th.sync_save_events[2].done = True
    assert pick(q) == 5


def test_known_slot_release_time_is_checked_not_waited_for() -> None:
    now = time.perf_counter_ns()
    q, _ = make(FakeThread(slot_times={3: now + 10**12, 4: 0}))
    q.put(Task(3))
    q.put(Task(4))
    assert pick(q) == 4


def test_sentinel_is_a_barrier() -> None:
    q, _ = make()
    q.put(Task(3, wait_for_save_layer=1))
    q.put(None)
    q.put(Task(4))
    assert pick(q) == 3 and q.bypassed == 0


def test_earlier_step_sharing_a_request_is_never_passed() -> None:
    q, th = make()
    req = type("R", (), {"req_id": "r1"})()
    rng = type("Rng", (), {"request": req})()
    tt = type("TT", (), {"block_ranges": [rng], "shared_block_data": None})()
    q.put(Task(6, wait_for_save_layer=1, transfer_tasks=[tt]))
    q.put(Task(0, transfer_tasks=[tt]))  # a new step (layer ids restart), same request
    assert pick(q) == 6 and q.bypassed == 0
    assert q.blocked_by[rules.SAME_REQUEST] == 1


def test_head_waiting_on_the_device_only_is_handed_out_rather_than_polled() -> None:
    q, th = make()
    q.put(Task(3, wait_for_save_layer=1))
    q.put(Task(5, wait_for_save_layer=2))
    th.layer_save_finished_events[1].set()
    th.sync_save_events[1].done = False  # CPU event set, the D2H still running: only the device is left
    assert pick(q) == 3  # blocks in upstream's synchronize() as FIFO would; nothing else was ready


def test_a_save_set_wakes_a_blocked_get() -> None:
    import threading

    q, th = make()
    q.put(Task(3, wait_for_save_layer=1))
    q.put(Task(5, wait_for_save_layer=2))  # could pass once save 2 is set: the thread waits for a signal
    got: list[int] = []
    t = threading.Thread(target=lambda: got.append(q.get().layer_id), daemon=True)
    t.start()
    time.sleep(0.05)
    assert not got
    th.layer_save_finished_events[1].set()
    t.join(2)
    assert got == [3]


def test_runtime_switch_back_to_fifo_drains_in_order() -> None:
    q, _ = make()
    q.put(Task(3, wait_for_save_layer=1))
    q.put(Task(4))
    q.put(Task(5))
    q.set_policy("fifo")
    assert [pick(q), pick(q), pick(q)] == [3, 4, 5]


def test_unknown_scheduler_is_one_clear_error_and_env_falls_back(caplog: pytest.LogCaptureFixture) -> None:
    from otel_kvtrace.schedule import check_scheduler, from_env

    with pytest.raises(ValueError, match="unknown 'readyq'; choose from fifo, ready_queue"):
        check_scheduler("readyq")
    with pytest.raises(ValueError, match="predicted by `kvtrace whatif` only"):
        check_scheduler("gate_group")
    assert from_env({"OTEL_KVTRACE_SCHEDULER": "readyq"}) == "fifo"
    assert sum("OTEL_KVTRACE_SCHEDULER=readyq ignored" in r.message for r in caplog.records) == 1
    assert from_env({}) == "fifo" and from_env({"OTEL_KVTRACE_SCHEDULER": "Ready_Queue"}) == "ready_queue"
