"""``gate_group`` live: one case per rule of the merged backend call (``rules.gate_batch``), with fake
events (deterministic), then on the threaded replica's real recv thread, and the refusal on upstream's."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import pytest

from otel_kvtrace.replica import backend, kv_transfer
from otel_kvtrace.replica.config import ReplicaConfig, SlowInjection
from otel_kvtrace.replica.threaded import run_threaded
from otel_kvtrace.schedule import attach, check_scheduler, from_env
from otel_kvtrace.schedule.queue import SchedulingQueue

from .fakes import FakeGate, FakeThread, Task


def make(num_layers: int = 8, policy: str = "gate_group") -> SchedulingQueue:
    return SchedulingQueue(FakeThread(num_layers=num_layers), policy)


def claim(q: SchedulingQueue, *tasks: Task | None) -> list[int]:
    """Queue ``tasks``, take the head as ``get()`` would (FIFO), return the layers that join its call."""
    for t in tasks:
        q.put(t)
    head = q.get(block=False)
    return [m.layer_id for m in q.claim_gate_group(head)]


def test_the_queued_tasks_of_the_head_s_gate_join_its_call_and_stay_queued_in_fifo_order() -> None:
    q, g = make(), FakeGate()
    assert claim(q, Task(1, attention_start_gate=g), Task(2, attention_start_gate=g),
                 Task(3, attention_start_gate=g)) == [2, 3]
    assert [q.get(block=False).layer_id, q.get(block=False).layer_id] == [2, 3]  # each still gets its own get()


def test_the_final_layer_never_joins() -> None:
    g = FakeGate()
    assert claim(make(num_layers=4), Task(1, attention_start_gate=g), Task(2, attention_start_gate=g),
                 Task(3, attention_start_gate=g)) == [2]


def test_a_same_chain_successor_never_joins_and_ends_the_batch() -> None:
    g = FakeGate()
    # 2 writes the buffer layer 1 (the head, not loaded yet) is loaded into: it would wait on its own batch
    assert claim(make(), Task(1, attention_start_gate=g), Task(2, wait_for_save_layer=1, attention_start_gate=g),
                 Task(3, attention_start_gate=g)) == []
    # a save source before the head is done (one recv thread, FIFO): that member joins
    assert claim(make(), Task(2, attention_start_gate=g), Task(3, wait_for_save_layer=0, attention_start_gate=g),
                 ) == [3]


def test_another_gate_another_step_or_no_gate_ends_the_batch() -> None:
    g, other = FakeGate(), FakeGate()
    assert claim(make(), Task(1, attention_start_gate=g), Task(2, attention_start_gate=other)) == []
    assert claim(make(), Task(5, attention_start_gate=g), Task(1, attention_start_gate=g)) == []  # next step
    assert claim(make(), Task(1), Task(2)) == []  # the head has no gate: nothing was opened for a member


def test_the_shutdown_sentinel_is_a_barrier() -> None:
    g = FakeGate()
    assert claim(make(), Task(1, attention_start_gate=g), None, Task(2, attention_start_gate=g)) == []


def test_other_policies_and_a_stale_head_claim_nothing() -> None:
    g = FakeGate()
    for policy in ("fifo", "ready_queue"):
        assert claim(make(policy=policy), Task(1, attention_start_gate=g), Task(2, attention_start_gate=g)) == []
    q = make()
    q.put(Task(1, attention_start_gate=g))
    q.put(Task(2, attention_start_gate=g))
    assert q.claim_gate_group(Task(1, attention_start_gate=g)) == []  # not the task get() handed out


# -- the threaded replica's real recv thread ----------------------------------------------------------
HOL = ReplicaConfig(num_layers=8, num_shared_buffers=2, prefetch_layers=4, independent_layers=(0, 4), steps=3,
                    slow=SlowInjection(slow_save_layers=(1,), slow_save_us=2000))


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Blocks per load (G2L) backend call, in call order."""
    log: list[int] = []
    original = backend.FakeStoreClient.batch_copy

    def record(self: object, srcs: list[int], dsts: list[int], sizes: list[int], direction: int) -> int:
        if direction == backend.G2L:
            log.append(len(sizes))
        return original(self, srcs, dsts, sizes, direction)  # type: ignore[arg-type]

    monkeypatch.setattr(backend.FakeStoreClient, "batch_copy", record)
    return log


def test_replica_copies_a_gate_s_layers_in_one_call_and_keeps_every_constraint(loads: list[int]) -> None:
    fifo = run_threaded(HOL)
    fifo_calls = list(loads)
    loads.clear()
    gg = run_threaded(dataclasses.replace(HOL, scheduler="gate_group"))
    assert fifo.error is None and gg.error is None and gg.clean_shutdown
    assert len(fifo_calls) == 8 * HOL.steps
    # per step, layer 2 (gate G_0, like 1; 3 waits on 1's save: chain) is copied in layer 1's call
    assert len(loads) == 7 * HOL.steps and sum(loads) == sum(fifo_calls)
    assert loads[1] == fifo_calls[1] + fifo_calls[2]
    assert gg.unfinished_tasks == fifo.unfinished_tasks == {
        "KVCacheStoreLayerRecvingThread": 0, "KVCacheStoreLayerSendingThread": 0}  # task_done once per task
    assert len(gg.lease_releases) == HOL.steps  # lease released after the final layer, once per step
    assert gg.finished_requests == fifo.finished_requests


def test_a_failed_merged_copy_kills_the_thread_like_upstream() -> None:
    cfg = dataclasses.replace(HOL, steps=2, slow=dataclasses.replace(HOL.slow, fail_copy_at=(0, 1)))
    fifo = run_threaded(cfg, wait_timeout_s=0.2)
    gg = run_threaded(dataclasses.replace(cfg, scheduler="gate_group"), wait_timeout_s=0.2)
    for result in (fifo, gg):
        assert isinstance(result.error, RuntimeError)  # raise_if_failed in the forward's wait
        assert "layer 1" in str(result.error.__cause__)
        assert result.unfinished_tasks["KVCacheStoreLayerRecvingThread"] >= 1


def test_shutdown_behind_a_waiting_head_ends_the_thread() -> None:
    from tests.schedule.test_replica_scheduler import _bare_recv_thread

    thread = _bare_recv_thread("gate_group")
    q = thread.request_queue
    thread.add_request(kv_transfer.LayerLoadTask(1, [], 2, None))  # waits on layer 1's save
    thread.start()
    thread.stop()  # the sentinel queues behind it and is never part of a batch
    time.sleep(0.01)
    assert thread.is_alive()
    thread.layer_save_finished_events[1].set()
    thread.join(2)
    assert not thread.is_alive() and q.unfinished_tasks == 0


def test_upstream_threads_refuse_gate_group_with_the_reason(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ValueError, match="one backend call, which upstream's one-layer _handle_request cannot"):
        check_scheduler("gate_group")
    with caplog.at_level(logging.WARNING, logger="otel_kvtrace"):
        assert from_env({"OTEL_KVTRACE_SCHEDULER": "gate_group"}) == "fifo"  # vLLM: one warning, FIFO
    assert sum("gate_group" in r.message for r in caplog.records) == 1

    with pytest.raises(ValueError, match="cannot run on vLLM-Ascend's recv threads"):
        attach(FakeThread(), "gate_group")  # a recv thread without the merged copy (upstream's)


def test_a_slot_waiter_is_called_for_every_member_of_a_merged_copy(loads: list[int]) -> None:
    """main with a sibling connector's slot release (``slow-slot``): each merged layer's slot is waited
    for before the one copy, as FIFO waits for each before its own."""
    cfg = dataclasses.replace(HOL, behaviour="main", slow=dataclasses.replace(
        HOL.slow, slow_slot_release_layers=(3,), slow_slot_release_us=3000.0))
    fifo = run_threaded(cfg)
    fifo_calls = list(loads)
    loads.clear()
    gg = run_threaded(dataclasses.replace(cfg, scheduler="gate_group"))
    assert fifo.error is None and gg.error is None and gg.clean_shutdown
    assert len(loads) < len(fifo_calls) and sum(loads) == sum(fifo_calls)
    assert gg.unfinished_tasks["KVCacheStoreLayerRecvingThread"] == 0


def test_gate_group_on_the_key_path_is_a_parameter_error() -> None:
    from otel_kvtrace.replica.config import ReplicaConfigError

    with pytest.raises(ReplicaConfigError, match="GVA path"):
        dataclasses.replace(HOL, path="key", scheduler="gate_group").validate()
