"""Conformance: the instrumentation on the REAL vLLM-Ascend recv threads (release sdist, or main).

Each test starts the upstream ``KVCacheStoreLayerRecvingThread`` / ``KVCacheStoreKeyLayerRecvingThread``
for real, feeds it real ``LayerLoadTask``s through ``add_request``, plays the producer (save events, gate
records, fake NPU completions) from the test thread, and checks the spans built from the recorded task
against what the thread actually did: the fake backend's call times, the fake NPU completion times and
the times the test fired each dependency. Version differences (research note section 1) are asserted,
not skipped: main synchronizes the save NPU event and dies on a failed copy; 0.23 does neither.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from otel_kvtrace.api import start_tracing

from tests.polling import wait_until
from .harness import (
    FakeBackend,
    FakeNpuEvent,
    Upstream,
    epoch_of,
    exported_spans,
    records_to_spans,
    task_traces,
)

pytestmark = pytest.mark.upstream

TOL_NS = 5_000  # float perf_counter() vs perf_counter_ns() rounding, plus the clock read itself
N_LAYERS = 4


@pytest.fixture
def tracing(upstream: Upstream) -> Iterator[Any]:
    session = start_tracing(upstream.binding.to_targets(), exporter=None, run_id="conformance")
    yield session
    session.shutdown()


def traces_after(session: Any, count: int) -> list[Any]:
    """The first ``count`` task traces once the recv thread has handed them to the recorder."""
    assert wait_until(lambda: session.stats().submitted >= count), session.stats()
    return task_traces(records_to_spans(session))


def later(delay_s: float, action: Any) -> threading.Thread:
    """Run ``action`` on a producer thread after ``delay_s`` (plays the forward / send thread)."""
    def run() -> None:
        time.sleep(delay_s)
        action()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def stamp(log: dict[str, float], name: str, action: Any) -> Any:
    """``action`` bracketed by perf_counter reads: the dependency time must fall in between."""
    def run() -> None:
        log[name + "_before"] = time.perf_counter()
        action()
        log[name + "_after"] = time.perf_counter()

    return run


# ---- plain task -----------------------------------------------------------------------------------


def test_a_no_op_stagger_is_called_unwrapped_and_recorded_at_the_copy(upstream: Upstream, monkeypatch: Any) -> None:
    """Wrapper path, h2d_stagger_us == 0: the instance calls upstream's own ``_stagger_h2d_submit`` (no
    frame of ours), the zero-length h2d_stagger stage is written at the copy's start, and shutdown removes
    the shortcut."""
    monkeypatch.setenv("OTEL_KVTRACE_PROBES", "wrappers")
    session = start_tracing(upstream.binding.to_targets(), exporter=None, run_id="stagger")
    try:
        env = upstream.gva_thread(N_LAYERS, FakeBackend(), start=False)
        assert env.thread.h2d_stagger_us == 0
        env.thread.add_request(upstream.gva_task(0, [upstream.request("r1", 3)]))
        env.thread._handle_request(env.thread.request_queue.get())
        unwrapped = type(env.thread)._stagger_h2d_submit.__kvtrace_wrapped__
        assert env.thread.__dict__["_stagger_h2d_submit"].__func__ is unwrapped
        (task,) = traces_after(session, 1)
        stagger, submit = task.children["h2d_stagger"], task.children["backend_submit"]
        assert stagger.start == stagger.end == submit.start
    finally:
        session.shutdown()
    assert "_stagger_h2d_submit" not in env.thread.__dict__


def test_compiled_probes_leave_the_stage_methods_upstreams_own(upstream: Upstream) -> None:
    """Compiled path (the default): stagger and batch copy are upstream's methods, not wrapped, and the
    stages are still recorded (stagger before the copy)."""
    cls = upstream.binding.classes["recv_gva"]
    stagger, handle = cls.__dict__["_stagger_h2d_submit"], cls.__dict__["_handle_request"]
    session = start_tracing(upstream.binding.to_targets(), exporter=None, run_id="compiled")
    try:
        assert getattr(cls.__dict__["_handle_request"], "__kvtrace_compiled__", False) is True
        assert cls.__dict__["_stagger_h2d_submit"] is stagger
        assert "_batch_copy_with_limits" not in cls.__dict__  # inherited from KVTransferThread, not wrapped
        env = upstream.gva_thread(N_LAYERS, FakeBackend(), start=False)
        env.thread.add_request(upstream.gva_task(0, [upstream.request("r1", 3)]))
        env.thread._handle_request(env.thread.request_queue.get())
        (task,) = traces_after(session, 1)
        assert task.children["h2d_stagger"].end <= task.children["backend_submit"].start
    finally:
        session.shutdown()
    assert cls.__dict__["_handle_request"] is handle  # uninstall restores upstream's own function


def test_plain_task_stages_bracket_the_real_backend_call(upstream: Upstream, tracing: Any) -> None:
    backend = FakeBackend(copy_s=0.002)
    env = upstream.gva_thread(N_LAYERS, backend)
    env.thread.add_request(upstream.gva_task(0, [upstream.request("r1", 3)]))

    (task,) = traces_after(tracing, 1)

    assert task.stage_names() == ["queue_wait", "meta_build", "h2d_stagger", "backend_submit", "completion"]
    (copy,) = [c for c in backend.calls if c.op == "batch_copy"]
    submit = task.children["backend_submit"]
    assert submit.start <= epoch_of(tracing, copy.start) + TOL_NS
    assert submit.end + TOL_NS >= epoch_of(tracing, copy.end)
    n_entries, total_bytes, direction, result = copy.args
    assert (direction, result) == (1, 0)
    assert task.attrs["kvtrace.bytes"] == total_bytes == submit.attrs["kvtrace.bytes"]
    assert submit.attrs["kvtrace.result"] == 0
    assert task.attrs["kvtrace.num_blocks"] == 3
    assert task.attrs["kvtrace.request_ids"] == ["r1"]
    assert task.attrs["kvtrace.outcome"] == "ok"
    assert task.attrs["kvtrace.path"] == "gva"
    assert task.attrs["kvtrace.layer_id"] == 0
    assert "kvtrace.wait_for_save_layer" not in task.attrs and "kvtrace.gate_id" not in task.attrs
    assert env.load_done[0].is_set() and env.get_event.is_set()
    assert task.attrs["kvtrace.ts.complete"] <= task.root.end
    assert env.thread.request_queue.unfinished_tasks == 0


# ---- save wait ------------------------------------------------------------------------------------


def test_save_wait_records_producer_set_time_and_npu_sync_on_main(upstream: Upstream, tracing: Any) -> None:
    backend = FakeBackend()
    env = upstream.gva_thread(N_LAYERS, backend)
    marks: dict[str, float] = {}
    env.sync_save[0].lag_s = 0.015  # device reaches layer 0's save point 15 ms after the host records it

    def produce() -> None:
        env.sync_save[0].record()  # forward: save_kv_layer(0) records the NPU event ...
        stamp(marks, "set", env.save_done[0].set)()  # ... then the send thread sets the CPU event

    env.thread.add_request(upstream.gva_task(2, [upstream.request("r1", 2)], wait_for_save_layer=0))
    later(0.02, produce)
    (task,) = traces_after(tracing, 1)

    assert task.attrs["kvtrace.wait_for_save_layer"] == 0
    cpu_wait = task.children["save_cpu_wait"]
    assert cpu_wait.attrs["kvtrace.src_layer"] == 0
    dep = task.attrs["kvtrace.ts.dep.save_cpu"]
    assert epoch_of(tracing, marks["set_before"]) - TOL_NS <= dep <= epoch_of(tracing, marks["set_after"]) + TOL_NS
    assert cpu_wait.end >= dep - TOL_NS
    assert not env.save_done[0].is_set(), "the recv thread clears the consumed save event"
    if upstream.binding.flags["recv_save_npu_sync"]:  # main: NPU sync after the CPU wait, then the build
        assert task.stage_names()[:4] == ["queue_wait", "save_cpu_wait", "save_npu_sync", "meta_build"]
        npu_done = epoch_of(tracing, env.sync_save[0].done_at)
        sync = task.children["save_npu_sync"]
        assert sync.end + TOL_NS >= npu_done, "synchronize() cannot return before the device completes"
        lo = task.attrs.get("kvtrace.ts.dep.save_npu_lo", task.attrs.get("kvtrace.ts.dep.save_npu"))
        hi = task.attrs.get("kvtrace.ts.dep.save_npu_hi", task.attrs.get("kvtrace.ts.dep.save_npu"))
        assert lo - TOL_NS <= npu_done <= hi + TOL_NS
        assert task.attrs["kvtrace.ts.ready"] >= npu_done - TOL_NS
        assert env.sync_save[0].sync_calls == 1
    else:  # 0.23: the build runs before the save wait, and there is no NPU sync in the recv thread
        assert task.stage_names()[:3] == ["queue_wait", "meta_build", "save_cpu_wait"]
        assert "save_npu_sync" not in task.children
        assert env.sync_save[0].sync_calls == 0
        assert task.attrs["kvtrace.ts.ready"] == dep
    assert task.children["backend_submit"].start >= cpu_wait.end


# ---- gated prefetch -------------------------------------------------------------------------------


def test_gated_prefetch_splits_condition_wait_and_npu_sync(upstream: Upstream, tracing: Any) -> None:
    backend = FakeBackend()
    env = upstream.gva_thread(N_LAYERS, backend)
    gate = upstream.gate_class()
    FakeNpuEvent.device_lag_s = 0.01  # attention of layer c starts 10 ms after the host records the gate
    marks: dict[str, float] = {}
    env.thread.add_request(upstream.gva_task(1, [upstream.request("r1", 2)], gate=gate))
    later(0.02, stamp(marks, "record", gate.record))
    (task,) = traces_after(tracing, 1)

    assert task.stage_names() == ["queue_wait", "meta_build", "gate_cond_wait", "gate_npu_sync", "h2d_stagger",
                                  "backend_submit", "completion"]
    cond, sync = task.children["gate_cond_wait"], task.children["gate_npu_sync"]
    record_at = task.attrs["kvtrace.ts.dep.gate_record"]
    assert epoch_of(tracing, marks["record_before"]) - TOL_NS <= record_at
    assert record_at <= epoch_of(tracing, marks["record_after"]) + TOL_NS
    assert cond.end == sync.start and abs(cond.end - record_at) <= TOL_NS
    npu_done = epoch_of(tracing, gate._event.done_at)
    assert sync.end + TOL_NS >= npu_done
    lo, hi = task.attrs["kvtrace.ts.dep.gate_npu_lo"], task.attrs["kvtrace.ts.dep.gate_npu_hi"]
    assert lo - TOL_NS <= npu_done <= hi + TOL_NS
    assert task.attrs["kvtrace.ready_precision"] == "bounded"
    assert "kvtrace.gate_id" in task.attrs and cond.attrs["kvtrace.gate_id"] == task.attrs["kvtrace.gate_id"]
    assert task.children["backend_submit"].start >= sync.end


# ---- empty task -----------------------------------------------------------------------------------


def test_empty_reuse_task_waits_for_its_source_then_completes_without_copy(upstream: Upstream, tracing: Any) -> None:
    backend = FakeBackend()
    env = upstream.gva_thread(N_LAYERS, backend)
    env.sync_save[1].lag_s = 0.005
    env.thread.add_request(upstream.gva_task(3, [], wait_for_save_layer=1))
    later(0.01, lambda: (env.sync_save[1].record(), env.save_done[1].set()))
    (task,) = traces_after(tracing, 1)

    assert task.attrs["kvtrace.outcome"] == "empty"
    assert task.attrs["kvtrace.num_blocks"] == 0 and task.attrs["kvtrace.bytes"] == 0
    expected = ["queue_wait", "save_cpu_wait"]
    if upstream.binding.flags["recv_save_npu_sync"]:
        expected.append("save_npu_sync")
    assert task.stage_names() == expected
    assert backend.ops() == []
    assert env.load_done[3].is_set() and not env.get_event.is_set(), "empty tasks do not set get_event"
    assert env.thread.request_queue.unfinished_tasks == 0


def test_empty_task_without_dependency_is_only_queued(upstream: Upstream, tracing: Any) -> None:
    env = upstream.gva_thread(N_LAYERS, FakeBackend())
    env.thread.add_request(upstream.gva_task(2, []))
    (task,) = traces_after(tracing, 1)
    assert task.stage_names() == ["queue_wait"]
    assert task.attrs["kvtrace.outcome"] == "empty"
    assert task.attrs["kvtrace.ts.ready"] == task.attrs["kvtrace.ts.enqueue"]


# ---- failing batch_copy ---------------------------------------------------------------------------


def test_failing_batch_copy_is_traced_with_the_version_specific_aftermath(upstream: Upstream, tracing: Any) -> None:
    backend = FakeBackend()
    backend.results = [7]
    env = upstream.gva_thread(N_LAYERS, backend)
    env.thread.add_request(upstream.gva_task(0, [upstream.request("r1", 2)]))
    env.thread.add_request(upstream.gva_task(1, [upstream.request("r1", 2)]))

    if upstream.is_main:  # the thread dies: no event set, no task_done, the next task stays queued
        (task,) = traces_after(tracing, 1)
        assert wait_until(lambda: not env.thread.is_alive())
        assert isinstance(env.thread._fatal_error, RuntimeError)
        with pytest.raises(RuntimeError):
            env.thread.raise_if_failed()
        assert env.thread.request_queue.unfinished_tasks == 2
        assert not env.load_done[0].is_set()
        assert task.root.status_code == 2  # ERROR
        assert task.attrs["kvtrace.outcome"] == "error"
        assert task.children["completion"].end == task.attrs["kvtrace.ts.complete"]  # ends at the raise
    else:  # 0.23 logs, sets the load event anyway and goes on with the next task
        first, second = traces_after(tracing, 2)
        task = first
        assert env.thread.is_alive() and env.load_done[0].is_set() and env.load_done[1].is_set()
        assert env.thread.request_queue.unfinished_tasks == 0
        assert second.children["backend_submit"].attrs["kvtrace.result"] == 0
        # nothing raised, but the copy failed: exported as an error with the result code as the reason
        assert task.root.status_code == 2 and task.attrs["kvtrace.outcome"] == "error"
        assert "result code 7" in task.root.status_message
    assert task.children["backend_submit"].attrs["kvtrace.result"] == 7
    assert [c.args[3] for c in backend.calls if c.op == "batch_copy"][0] == 7


# ---- key-based path -------------------------------------------------------------------------------


def test_key_path_traces_gate_and_synchronous_get(upstream: Upstream, tracing: Any) -> None:
    backend = FakeBackend(copy_s=0.002)
    env = upstream.key_thread(N_LAYERS, backend)
    gate = upstream.gate_class()
    env.thread.add_request(upstream.key_task(1, upstream.request("r2", 2), gate=gate))
    later(0.01, gate.record)
    (task,) = traces_after(tracing, 1)

    assert task.attrs["kvtrace.path"] == "key"
    names = task.stage_names()
    assert names == ["queue_wait", "gate_cond_wait", "gate_npu_sync", "meta_build", "backend_submit", "completion"]
    assert task.children["meta_build"].end <= task.children["backend_submit"].start  # key + address build
    (get,) = [c for c in backend.calls if c.op == "get"]
    submit = task.children["backend_submit"]
    assert submit.start <= epoch_of(tracing, get.start) + TOL_NS
    assert submit.end + TOL_NS >= epoch_of(tracing, get.end)
    assert len(get.args[0]) == 2 and all("@layer_id:1@" in k for k in get.args[0])
    assert env.load_done[1].is_set()


# ---- head-of-line evidence --------------------------------------------------------------------------


def test_trace_shows_ready_task_stuck_behind_a_head_waiting_for_its_save(upstream: Upstream, tmp_path: Path) -> None:
    """Layer 1 waits for the save of layer 0 while layer 2 (no dependency) is ready behind it.

    Read back from the OTLP/JSON lines file the real exporter wrote, as the analysis would.
    """
    session = start_tracing(upstream.binding.to_targets(), out_dir=tmp_path, run_id="hol")
    try:
        env = upstream.gva_thread(N_LAYERS, FakeBackend())
        env.thread.add_request(upstream.gva_task(1, [upstream.request("r1", 2)], wait_for_save_layer=0))
        env.thread.add_request(upstream.gva_task(2, [upstream.request("r1", 2)]))
        later(0.03, lambda: (env.sync_save[0].record(), env.save_done[0].set()))
        assert wait_until(lambda: session.stats().submitted == 2)
    finally:
        session.shutdown()
    head, behind = task_traces(exported_spans(tmp_path))

    assert (head.attrs["kvtrace.layer_id"], behind.attrs["kvtrace.layer_id"]) == (1, 2)
    head_dep_met = head.attrs["kvtrace.ts.dep.save_cpu"]
    assert behind.attrs["kvtrace.ts.ready"] < head_dep_met, "layer 2 was ready before layer 1's save finished"
    assert behind.attrs["kvtrace.ts.ready"] < head.attrs["kvtrace.ts.ready"]
    assert behind.attrs["kvtrace.ts.dequeue"] >= head.attrs["kvtrace.ts.complete"], "FIFO: served after the head"
    assert behind.children["queue_wait"].end > head_dep_met


# ---- forward side on the real KVPoolWorker ----------------------------------------------------------


def test_real_worker_steps_gates_and_consumer_waits(upstream: Upstream, tracing: Any) -> None:
    """The real ``KVPoolWorker`` starts the real threads (P0 post-hook) and drives two steps (P1, P2, P13)."""
    from .harness import drive_step, pool_worker

    num_layers, prefetch = 4, 2
    worker = pool_worker(upstream, num_layers, prefetch, FakeBackend(copy_s=0.003))
    for _ in range(2):
        drive_step(upstream, worker, {layer: [upstream.request("r1", 2)] for layer in range(num_layers)})
    tasks = traces_after(tracing, 2 * num_layers)

    assert [(t.attrs["kvtrace.step"], t.attrs["kvtrace.layer_id"]) for t in tasks] == [
        (step, layer) for step in range(2) for layer in range(num_layers)]
    for t in tasks:
        step, layer = t.attrs["kvtrace.step"], t.attrs["kvtrace.layer_id"]
        assert t.attrs["kvtrace.correlation_id"].endswith(f"/gva/s{step}/l{layer}")
    # P=2: T0 has no gate, T1 gets G0 at c=0, then T(c+1) gets G(c) (research note 2.4)
    assert [t.attrs.get("kvtrace.gate_id") for t in tasks[:num_layers]] == [None, 0, 1, 2]
    for t in tasks:
        wait = t.children["consumer_wait"]
        assert wait.attrs["kvtrace.thread"] == "forward"
        assert wait.end >= t.attrs["kvtrace.ts.complete"] - TOL_NS, "the forward returns after the load is set"
        assert t.root.end >= wait.end
    assert tasks[-1].attrs["kvtrace.final_layer"] is True


# ---- exact device times (OTEL_KVTRACE_NPU_TIMING=1) -------------------------------------------------


def test_npu_timing_turns_bounds_into_the_device_completion_time(upstream: Upstream) -> None:
    session = start_tracing(upstream.binding.to_targets(), exporter=None, run_id="npu", npu_timing=True)
    try:
        env = upstream.gva_thread(N_LAYERS, FakeBackend())
        gate = upstream.gate_class()
        FakeNpuEvent.device_lag_s = 0.0
        env.sync_save[0].lag_s = 0.01  # before add_request: attaching replaces the list items by proxies
        env.thread.add_request(upstream.gva_task(2, [upstream.request("r1", 2)], wait_for_save_layer=0, gate=gate))

        def produce() -> None:
            env.sync_save[0].record()
            env.save_done[0].set()
            time.sleep(0.005)
            FakeNpuEvent.device_lag_s = 0.01
            gate.record()

        later(0.01, produce)
        (task,) = traces_after(session, 1)
    finally:
        session.shutdown()
    gate_done = epoch_of(session, gate._event.done_at)
    assert task.attrs["kvtrace.ts.dep.gate_npu"] == pytest.approx(gate_done, abs=1_000_000)
    assert "kvtrace.ts.dep.gate_npu_lo" not in task.attrs
    if upstream.binding.flags["recv_save_npu_sync"]:
        save_done = epoch_of(session, env.sync_save[0].done_at)
        assert task.attrs["kvtrace.ts.dep.save_npu"] == pytest.approx(save_done, abs=1_000_000)
        assert task.attrs["kvtrace.ready_precision"] == "exact"
    assert task.attrs["kvtrace.ts.ready"] == pytest.approx(max(gate_done, task.attrs["kvtrace.ts.dep.save_cpu"]),
                                                           abs=1_000_000)


def test_real_send_thread_feeds_save_dependencies_and_reuse_hol_is_visible(upstream: Upstream) -> None:
    """Real worker + real send and recv threads, main's reuse layout N=8 B=2 P=4 independent=[0,4].

    The research note observed it on CPU: T4 (independent, ready once gate G1 opens) sits behind T3,
    which waits for the save of layer 1. The trace must show it, with the save time coming from the
    real send thread (and linked to its save span). On 0.23 there is no reuse: no task has a source.
    """
    import importlib

    from .harness import drive_step, pool_worker

    n = 8
    pool_worker_module = importlib.import_module(upstream.binding.modules["pool_worker"])
    build = getattr(pool_worker_module, "build_layerwise_cache_layout", None)
    if build is not None:
        layout = build(n, {"layerwise_num_shared_buffers": 2, "layerwise_prefetch_layers": 4,
                           "layerwise_independent_layers": [0, 4]})
        prefetch, reuse_map = layout.num_prefetch_layers, layout.prefetch_layer_map
        assert reuse_map == {3: 1, 5: 2, 6: 3, 7: 5}
    else:
        prefetch, reuse_map = 4, {}
    session = start_tracing(upstream.binding.to_targets(), exporter=None, run_id="reuse", npu_timing=True)
    try:
        backend = FakeBackend(copy_s=0.001, save_copy_s=0.008)  # D2H saves are the slow part
        worker = pool_worker(upstream, n, prefetch, backend)
        worker.prefetch_layer_map = reuse_map
        FakeNpuEvent.device_lag_s = 0.002
        request = upstream.request("r1", 2)
        drive_step(upstream, worker, {layer: [request] for layer in range(n)}, {layer: [request] for layer in range(n)})
        assert wait_until(lambda: session.stats().submitted >= 2 * n)
        spans = records_to_spans(session)
    finally:
        session.shutdown()
    recv = {t.attrs["kvtrace.layer_id"]: t for t in task_traces(spans)}
    send = {t.attrs["kvtrace.layer_id"]: t for t in task_traces(spans, "kvtrace.send.task")}
    assert sorted(recv) == sorted(send) == list(range(n))
    saves = [c for c in backend.calls if c.op == "batch_copy" and c.args[2] == 0]
    assert len(saves) == n and all(send[layer].attrs["kvtrace.bytes"] == saves[0].args[1] for layer in send)
    if not reuse_map:
        assert all("kvtrace.wait_for_save_layer" not in t.attrs for t in recv.values())
        return
    for layer, src in reuse_map.items():
        task = recv[layer]
        assert task.attrs["kvtrace.wait_for_save_layer"] == src
        # the save dependency is met when the real send thread set the event, at the end of its task
        assert abs(task.attrs["kvtrace.ts.dep.save_cpu"] - send[src].attrs["kvtrace.ts.complete"]) <= 1_000_000
        assert task.links["save_cpu_wait"] == [send[src].trace_id]
    head, behind = recv[3], recv[4]
    assert behind.attrs["kvtrace.ready_precision"] == "exact"
    assert behind.attrs["kvtrace.ts.ready"] < head.attrs["kvtrace.ts.dep.save_cpu"], "T4 ready while T3 waits"
    assert behind.attrs["kvtrace.ts.dequeue"] >= head.attrs["kvtrace.ts.complete"]
    assert behind.attrs["kvtrace.ts.dequeue"] - behind.attrs["kvtrace.ts.ready"] > 5_000_000  # > 5 ms of HOL
