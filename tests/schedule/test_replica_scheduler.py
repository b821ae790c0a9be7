"""The live scheduler on the threaded replica's real recv thread (real threads, real clock)."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from otel_kvtrace.replica import kv_transfer
from otel_kvtrace.replica.config import ReplicaConfig, ReplicaConfigError, SlowInjection
from otel_kvtrace.replica.threaded import run_threaded
from otel_kvtrace.schedule import SchedulingQueue

# layer 3 waits on layer 1's slow save; independent layer 4 is queued behind it (measured order below)
HOL = ReplicaConfig(num_layers=8, num_shared_buffers=2, prefetch_layers=4, independent_layers=(0, 4), steps=3,
                    slow=SlowInjection(slow_save_layers=(1,), slow_save_us=4000))


@pytest.fixture
def handled(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int | None]]:
    """The (layer, wait_for_save_layer) of every task the recv thread handles, in order."""
    log: list[tuple[int, int | None]] = []
    original = kv_transfer.KVCacheStoreLayerRecvingThread._handle_request

    def record(self: object, data: object) -> None:
        log.append((data.layer_id, data.wait_for_save_layer))  # type: ignore[attr-defined]
        original(self, data)  # type: ignore[arg-type]

    monkeypatch.setattr(kv_transfer.KVCacheStoreLayerRecvingThread, "_handle_request", record)
    return log


def test_ready_queue_passes_the_slow_save_head_and_keeps_every_constraint(handled: list) -> None:
    fifo = run_threaded(HOL)
    fifo_order = list(handled)
    handled.clear()
    rq = run_threaded(dataclasses.replace(HOL, scheduler="ready_queue"))
    assert fifo.error is None and rq.error is None and rq.clean_shutdown
    assert fifo_order[:5] == [(0, None), (1, None), (2, None), (3, 1), (4, None)]
    assert handled[:5] == [(0, None), (1, None), (2, None), (4, None), (3, 1)]  # 4 went before the waiting 3
    assert sorted(handled) == sorted(fifo_order)  # every task exactly once
    per_step = [handled[i * 8:(i + 1) * 8] for i in range(HOL.steps)]
    assert all(step[-1] == (7, 5) for step in per_step)  # final layer last
    for step in per_step:  # a task waiting on layer s's save never runs before layer s's load
        pos = {layer: k for k, (layer, _) in enumerate(step)}
        assert all(pos[src] < pos[layer] for layer, src in step if src is not None)
    assert rq.unfinished_tasks == fifo.unfinished_tasks == {
        "KVCacheStoreLayerRecvingThread": 0, "KVCacheStoreLayerSendingThread": 0}  # one task_done per get
    assert len(rq.lease_releases) == len(fifo.lease_releases) == HOL.steps
    assert rq.finished_requests == fifo.finished_requests


def test_exception_in_a_task_that_bypassed_the_head_kills_the_thread_like_upstream(handled: list) -> None:
    cfg = dataclasses.replace(HOL, scheduler="ready_queue", steps=2,
                              slow=dataclasses.replace(HOL.slow, fail_copy_at=(0, 4)))
    result = run_threaded(cfg, wait_timeout_s=0.2)
    assert handled[-1] == (4, None) and (3, 1) not in handled  # 4 bypassed 3, then failed
    assert isinstance(result.error, RuntimeError)  # raise_if_failed in the forward's wait
    assert isinstance(result.error.__cause__, RuntimeError) and "layer 4" in str(result.error.__cause__)
    assert result.unfinished_tasks["KVCacheStoreLayerRecvingThread"] >= 1  # failed item never task_done'd


def test_shutdown_while_the_head_waits_ends_the_thread() -> None:
    thread = _bare_recv_thread()
    q = thread.request_queue
    assert isinstance(q, SchedulingQueue)
    thread.add_request(kv_transfer.LayerLoadTask(1, [], 2, None))  # waits on layer 1's save ...
    thread.add_request(kv_transfer.LayerLoadTask(0, [], 3, None))  # ... and so does this one (on layer 0's)
    thread.start()
    deadline = time.monotonic() + 30
    while q.blocked_by["dependency"] < 1 and time.monotonic() < deadline:  # the scheduler decided to wait
        time.sleep(0.001)
    assert thread.is_alive() and q.qsize() == 2  # the thread waits in the scheduler, not in a task
    thread.stop()  # the None sentinel queues behind the waiting head ...
    thread.layer_save_finished_events[1].set()  # ... the tasks complete, then the sentinel ends run()
    thread.layer_save_finished_events[0].set()
    thread.join(2)
    assert not thread.is_alive()
    assert q.unfinished_tasks == 0


def test_replica_rejects_a_scheduler_that_cannot_run_live() -> None:
    with pytest.raises(ReplicaConfigError, match="scheduler"):
        dataclasses.replace(HOL, scheduler="lifo").validate()
    dataclasses.replace(HOL, scheduler="gate_group").validate()  # the replica can make the merged call


def _bare_recv_thread(policy: str = "ready_queue") -> kv_transfer.KVCacheStoreLayerRecvingThread:
    from otel_kvtrace.replica.backend import FakeMStore, FakeTokenDatabase
    from otel_kvtrace.replica.fake_npu import FakeNPU, RealClock, set_default_device
    from otel_kvtrace.replica.plan import build_plan
    from otel_kvtrace.schedule import attach

    cfg = ReplicaConfig(num_layers=8, steps=1)
    plan = build_plan(cfg)
    npu = FakeNPU(RealClock())
    set_default_device(npu)
    n = cfg.num_layers
    thread = kv_transfer.KVCacheStoreLayerRecvingThread(
        FakeMStore(plan, npu), FakeTokenDatabase(plan, npu, 4096), 128, 0, 1, 1, 4096, threading.Event(),
        threading.Event(), [threading.Event() for _ in range(n)], [threading.Event() for _ in range(n)],
        [npu.Event() for _ in range(n)], n)
    assert attach(thread, policy) is not None
    return thread
