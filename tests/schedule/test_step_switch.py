"""The runtime switch at step boundaries (``install_scheduler``), as the fidelity bench's interleaved
design uses it, and in the middle of a step: on the threaded replica's real recv thread."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from otel_kvtrace.replica import backend, kv_transfer
from otel_kvtrace.replica.config import ReplicaConfig, SlowInjection
from otel_kvtrace.replica.pool_worker import KVPoolWorker
from otel_kvtrace.replica.threaded import replica_targets, run_threaded
from otel_kvtrace.schedule import install_scheduler

# layer 3 waits on layer 1's slow save; independent layer 4 is queued behind it; layer 2 shares gate G_0
HOL = ReplicaConfig(num_layers=8, num_shared_buffers=2, prefetch_layers=4, independent_layers=(0, 4), steps=9,
                    slow=SlowInjection(slow_save_layers=(1,), slow_save_us=4000), scheduler="ready_queue")
TARGETS = replica_targets()


@pytest.fixture(autouse=True)
def back_to_fifo() -> object:
    yield
    install_scheduler(TARGETS, "fifo")


@pytest.fixture
def log(monkeypatch: pytest.MonkeyPatch) -> dict[str, list]:
    """``handled``: (layer, save source) per recv task in order; ``loads``: blocks per load backend call."""
    out: dict[str, list] = {"handled": [], "loads": []}
    handle = kv_transfer.KVCacheStoreLayerRecvingThread._handle_request
    copy = backend.FakeStoreClient.batch_copy

    def record(self: object, data: object) -> None:
        out["handled"].append((data.layer_id, data.wait_for_save_layer))  # type: ignore[attr-defined]
        handle(self, data)  # type: ignore[arg-type]

    def count(self: object, srcs: list[int], dsts: list[int], sizes: list[int], direction: int) -> int:
        if direction == backend.G2L:
            out["loads"].append(len(sizes))
        return copy(self, srcs, dsts, sizes, direction)  # type: ignore[arg-type]

    monkeypatch.setattr(kv_transfer.KVCacheStoreLayerRecvingThread, "_handle_request", record)
    monkeypatch.setattr(backend.FakeStoreClient, "batch_copy", count)
    return out


def test_gate_group_switch_needs_a_recv_class_that_can_merge() -> None:
    assert install_scheduler(TARGETS, "gate_group") == "gate_group"  # the replica's GVA thread can
    upstream_like = {**TARGETS, "recv_thread_classes": (kv_transfer.KVCacheStoreKeyLayerRecvingThread,)}
    with pytest.raises(ValueError, match="cannot run on vLLM-Ascend's recv threads"):
        install_scheduler(upstream_like, "gate_group")


def test_each_step_runs_the_policy_switched_in_before_it(log: dict[str, list]) -> None:
    order = ["fifo", "ready_queue", "gate_group"] * 3
    marks: list[tuple[int, int]] = []

    def before(worker: KVPoolWorker, step: int) -> None:
        assert worker.drain()
        marks.append((len(log["handled"]), len(log["loads"])))
        install_scheduler(TARGETS, order[step])

    result = run_threaded(HOL, before_step=before)
    install_scheduler(TARGETS, "fifo")
    assert result.error is None and result.clean_shutdown
    marks.append((len(log["handled"]), len(log["loads"])))
    for step, policy in enumerate(order):
        (h0, c0), (h1, c1) = marks[step], marks[step + 1]
        handled, calls = log["handled"][h0:h1], c1 - c0
        layers = [layer for layer, _ in handled]
        assert sorted(layers) == list(range(8)) and layers[-1] == 7  # every task once, final layer last
        pos = {layer: k for k, layer in enumerate(layers)}
        assert all(pos[src] < pos[layer] for layer, src in handled if src is not None)  # buffer chain
        if policy == "ready_queue":
            assert pos[4] < pos[3]  # 4 passed 3, which waits on the slow save
        else:
            assert layers == list(range(8))  # FIFO order out of get()
        assert calls == (7 if policy == "gate_group" else 8)  # gate_group: layer 2 copied in layer 1's call
    assert result.unfinished_tasks == {"KVCacheStoreLayerRecvingThread": 0, "KVCacheStoreLayerSendingThread": 0}
    assert len(result.lease_releases) == HOL.steps


def test_switching_in_the_middle_of_steps_drains_safely(log: dict[str, list]) -> None:
    """A switch while tasks are queued (every 0.3 ms, through every policy): every task still runs once,
    in an order every constraint allows, and the thread ends cleanly."""
    stop = threading.Event()

    def flip() -> None:
        names = ("ready_queue", "gate_group", "fifo")
        k = 0
        while not stop.is_set():
            install_scheduler(TARGETS, names[k % 3])
            k += 1
            time.sleep(0.0003)

    flipper = threading.Thread(target=flip)
    flipper.start()
    try:
        result = run_threaded(dataclasses.replace(HOL, steps=20))
    finally:
        stop.set()
        flipper.join()
    install_scheduler(TARGETS, "fifo")
    assert result.error is None and result.clean_shutdown
    assert result.unfinished_tasks == {"KVCacheStoreLayerRecvingThread": 0, "KVCacheStoreLayerSendingThread": 0}
    handled = log["handled"]
    assert len(handled) == 8 * 20
    for s in range(20):
        step = handled[s * 8:(s + 1) * 8]
        pos = {layer: k for k, (layer, _) in enumerate(step)}
        assert sorted(pos) == list(range(8)) and step[-1][0] == 7
        assert all(pos[src] < pos[layer] for layer, src in step if src is not None)
    assert len(result.lease_releases) == 20 and sum(log["loads"]) > 0
