"""One case per rule of the live scheduler, with fake CPU/NPU events (deterministic: ``try_get()``)."""

from __future__ import annotations

import queue
import time
from typing import Any

import pytest

from otel_kvtrace.schedule import rules
from otel_kvtrace.schedule.queue import SchedulingQueue, hook_save_signals

from .fakes import FakeGate, FakeNpuEvent, FakeThread, Task


def make(thread: FakeThread | None = None, policy: str = "ready_queue") -> tuple[SchedulingQueue, FakeThread]:
    thread = thread or FakeThread()
    q = SchedulingQueue(thread, policy)
    hook_save_signals(q, thread.layer_save_finished_events)
    return q, thread


def pick(q: SchedulingQueue) -> int | None:
    try:
        return q.try_get().layer_id
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
    tt = _request("r1")
    q.put(Task(6, wait_for_save_layer=1, transfer_tasks=[tt]))
    q.put(Task(0, transfer_tasks=[tt]))  # a new step (layer ids restart), same request
    assert pick(q) == 6 and q.bypassed == 0
    assert q.blocked_by[rules.SAME_REQUEST] == 1


def _request(req_id: str) -> Any:
    """A transfer task of one request (what the same-request rule reads)."""
    rng = type("Rng", (), {"request": type("R", (), {"req_id": req_id})()})()
    return type("TT", (), {"block_ranges": [rng], "shared_block_data": None})()


def test_buffer_chain_holds_in_a_later_step_against_that_steps_first_queued_layer() -> None:
    """Head: step 1's layer 3, waiting on its save. Step 2 (another request) queues layer 1 (waits on save 0,
    not set) and layer 4, whose save source 2 was set in step 1 (stale for step 2): layer 4 may not pass,
    because step 2's first queued layer (1) is not loaded; the rule is asked per step, not per queue."""
    q, th = make(FakeThread(num_layers=16))
    q.put(Task(3, wait_for_save_layer=1, transfer_tasks=[_request("a")]))
    q.put(Task(1, wait_for_save_layer=0, transfer_tasks=[_request("b")]))  # a new step: layer ids restart
    q.put(Task(4, wait_for_save_layer=2, transfer_tasks=[_request("b")]))
    th.layer_save_finished_events[2].set()  # stale: set in step 1
    assert pick(q) is None  # nothing may go: both waiting tasks wait on a CPU signal, layer 4 on the chain
    assert q.bypassed == 0 and q.blocked_by[rules.BUFFER_CHAIN] == 1 and q.blocked_by[rules.DEPENDENCY] == 1
    th.layer_save_finished_events[1].set()
    assert [pick(q), pick(q), pick(q)] == [3, 1, 4] and q.bypassed == 0  # 1 alone ahead of 4: 4 waits for it


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
    deadline = time.monotonic() + 30
    while q.blocked_by[rules.DEPENDENCY] < 1 and time.monotonic() < deadline:  # get() decided to wait
        time.sleep(0.001)
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
    with pytest.raises(ValueError, match="cannot run on vLLM-Ascend's recv threads.*one-layer _handle_request"):
        check_scheduler("gate_group")
    assert check_scheduler("gate_group", merged_copy=True) == "gate_group"
    assert from_env({"OTEL_KVTRACE_SCHEDULER": "readyq"}) == "fifo"
    assert sum("OTEL_KVTRACE_SCHEDULER=readyq ignored" in r.message for r in caplog.records) == 1
    assert from_env({}) == "fifo" and from_env({"OTEL_KVTRACE_SCHEDULER": "Ready_Queue"}) == "ready_queue"


def test_get_non_blocking_and_timeout_behave_like_queue_queue() -> None:
    q, _ = make()
    for ref in (queue.Queue(), q):
        ref.put(Task(3, wait_for_save_layer=1))  # a head that waits
        ref.put(Task(5, wait_for_save_layer=2))  # nothing ready behind it
        with pytest.raises(ValueError, match="non-negative"):
            ref.get(timeout=-1)
        assert [ref.get(block=False).layer_id, ref.get(False, -1).layer_id] == [3, 5]  # the head, in order
        with pytest.raises(queue.Empty):
            ref.get(block=False)
        with pytest.raises(queue.Empty):
            ref.get(timeout=0.01)


def test_unreadable_slot_release_waiter_keeps_the_thread_fifo_and_says_so(
        caplog: pytest.LogCaptureFixture) -> None:
    from otel_kvtrace.schedule import attach

    def blocking_waiter(layer_id: int) -> None:  # main's waiter: a plain blocking callable
        raise AssertionError("the scheduler must not call the waiter")

    th = FakeThread()
    th.external_slot_release_waiter = blocking_waiter
    th.request_queue = queue.Queue()  # type: ignore[attr-defined]
    assert attach(th, "ready_queue") is None and type(th.request_queue) is queue.Queue
    said = [r.getMessage() for r in caplog.records if "slot release waiter" in r.getMessage()]
    assert len(said) == 1 and "stays fifo" in said[0]
    caplog.clear()
    q, th = make()  # a waiter wired after attach
    th.external_slot_release_waiter = blocking_waiter
    q.put(Task(3, wait_for_save_layer=1))
    q.put(Task(4))
    assert [pick(q), pick(q)] == [3, 4] and q.policy == "fifo" and q.bypassed == 0
    assert sum("slot release waiter" in r.getMessage() for r in caplog.records) == 1


class _DuringProbe(FakeNpuEvent):
    """An NPU event whose ``query()`` runs ``action`` (a producer acting while the scheduler probes)."""

    def __init__(self, action: Any, done: bool) -> None:
        super().__init__(done)
        self.action = action

    def query(self) -> bool:
        self.action()
        return super().query()


def test_probes_run_outside_the_queue_lock_and_the_pick_is_rechecked() -> None:
    q, th = make()
    unlocked: list[bool] = []

    def producer() -> None:
        free = q.mutex.acquire(blocking=False)  # a put or a save set() would get the lock now
        if free:
            q.mutex.release()
        unlocked.append(free)

    th.layer_save_finished_events[2].set()
    th.sync_save_events[2] = _DuringProbe(producer, done=True)  # type: ignore[assignment]
    q.put(Task(3, wait_for_save_layer=1))
    q.put(Task(5, wait_for_save_layer=2))
    assert pick(q) == 5 and unlocked == [True]
    assert pick(q) == 3  # alone: handed out to wait in upstream's own wait
    # a switch to fifo while the candidate is probed: the re-check under the lock hands out the head
    q.put(Task(3, wait_for_save_layer=1))
    q.put(Task(5, wait_for_save_layer=2))
    th.sync_save_events[2] = _DuringProbe(lambda: q.set_policy("fifo"), done=True)  # type: ignore[assignment]
    assert [pick(q), pick(q)] == [3, 5] and q.bypassed == 1


def test_a_signal_while_probing_is_not_lost() -> None:
    import threading

    now = time.perf_counter_ns()
    th = FakeThread(slot_times={4: now + 10**12})  # task 4's slot is released far in the future
    q, _ = make(th)
    gate = FakeGate()
    gate._event = _DuringProbe(lambda: th.layer_save_finished_events[1].set(), done=True)  # type: ignore[assignment]
    q.put(Task(3, wait_for_save_layer=1))  # the head waits for save 1 ...
    q.put(Task(4, attention_start_gate=gate))  # ... which the send thread sets while 4 is probed
    got: list[int] = []
    t = threading.Thread(target=lambda: got.append(q.get().layer_id), daemon=True)
    t.start()
    t.join(30)
    assert got == [3]


def test_a_traced_slot_waiter_stays_readable_so_tracing_does_not_change_the_schedule() -> None:
    import time
    from types import SimpleNamespace

    from otel_kvtrace.instrument.proxies import traced_slot_waiter
    from otel_kvtrace.schedule.queue import unreadable_waiter

    class Waiter:
        def __call__(self, layer_id: int) -> None:
            return None

        def kvtrace_release_time(self, layer_id: int) -> int:
            return 42

    rt = SimpleNamespace(recorder=SimpleNamespace(clock=time.perf_counter_ns))
    thread = SimpleNamespace(external_slot_release_waiter=traced_slot_waiter(Waiter(), rt, SimpleNamespace()))
    assert unreadable_waiter(thread) is None
    assert thread.external_slot_release_waiter.kvtrace_release_time(3) == 42


class _Broken(FakeNpuEvent):
    """A driver call that fails."""

    def query(self) -> bool:
        raise RuntimeError("driver says no")


@pytest.mark.parametrize("broken", [1, 2, 3], ids=["head's probe", "candidate's probe", "head's, nothing may pass"])
def test_a_failing_probe_turns_the_scheduler_off_not_the_thread(
        broken: int, caplog: pytest.LogCaptureFixture) -> None:
    """A probe that raises: one warning, the scheduler falls back to fifo, the head is handed out and every
    later get() is FIFO; the exception never reaches the recv thread. Head 3 waits on save 1 (set, its NPU
    event maybe broken); then 5 waiting on save 2 (set, its NPU event maybe broken) and 6, or (3: nothing
    may pass the head) only the final layer 7: the failure is reported even then."""
    q, th = make()
    th.layer_save_finished_events[1].set()
    th.layer_save_finished_events[2].set()
    th.sync_save_events[1] = _Broken() if broken in (1, 3) else FakeNpuEvent(done=False)  # type: ignore[assignment]
    th.sync_save_events[2] = _Broken() if broken == 2 else FakeNpuEvent()  # type: ignore[assignment]
    behind = [Task(7)] if broken == 3 else [Task(5, wait_for_save_layer=2), Task(6)]
    for task in [Task(3, wait_for_save_layer=1), *behind]:
        q.put(task)
    assert [pick(q) for _ in range(1 + len(behind))] == [3, *(t.layer_id for t in behind)]
    assert q.policy == "fifo" and q.bypassed == 0
    said = [r.getMessage() for r in caplog.records if "scheduler error" in r.getMessage()]
    assert len(said) == 1 and "RuntimeError: driver says no" in said[0]


class _EmptiesTheQueue(FakeNpuEvent):
    """A failing driver call during which another consumer takes every queued task."""

    def __init__(self, q: SchedulingQueue) -> None:
        super().__init__(done=False)
        self.q = q

    def query(self) -> bool:
        while self.q.queue:
            self.q._take(0)
        raise RuntimeError("driver says no")


def test_a_failing_probe_on_a_queue_emptied_meanwhile_says_empty() -> None:
    """Non-blocking ``get()`` keeps ``queue.Queue``'s contract (``Empty``, not an ``IndexError``) when the
    probe that failed ran while another consumer emptied the queue."""
    q, th = make()
    th.layer_save_finished_events[1].set()
    th.sync_save_events[1] = _EmptiesTheQueue(q)  # type: ignore[assignment]
    q.put(Task(3, wait_for_save_layer=1))
    q.put(Task(4))
    with pytest.raises(queue.Empty):
        q.get(block=False)
    assert q.policy == "fifo"


def test_the_first_task_of_a_later_step_is_not_held_by_the_heads_layer() -> None:
    """Head: step 1's layer 3, waiting. Step 2 (another request) starts with layer 1, whose save source 5
    is done: as the first queued task of its step no load of its step is unfinished before it, so the
    buffer chain does not hold it (judged against the head's layer 3, it would be)."""
    q, th = make()
    q.put(Task(3, wait_for_save_layer=1, transfer_tasks=[_request("a")]))
    q.put(Task(1, wait_for_save_layer=5, transfer_tasks=[_request("b")]))  # layer ids restart: step 2
    th.layer_save_finished_events[5].set()
    assert pick(q) == 1 and q.bypassed == 1


def test_the_wait_is_until_the_heads_known_release_time() -> None:
    """Head 3 waits for its slot release at a known time, 4 for a save signal: nothing may go, and the
    thread sleeps until the head's time (not until a signal that may never come)."""
    release = time.perf_counter_ns() + 50_000_000
    q, th = make(FakeThread(slot_times={3: release}))
    q.put(Task(3))
    q.put(Task(4, wait_for_save_layer=2))
    with q.mutex:
        got, wait_s, _ = q._decide()
    assert got == -1 and wait_s is not None and 0 < wait_s <= 0.05
