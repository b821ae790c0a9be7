"""Threaded real-clock replica: agrees with the virtual engine, shuts down cleanly, fails like upstream."""

from __future__ import annotations

import threading

import pytest

from otel_kvtrace.replica import gate as gate_module
from otel_kvtrace.replica.config import ReplicaConfig, SlowInjection, Timing
from otel_kvtrace.replica.fake_npu import FakeNPU, RealClock, set_default_device
from otel_kvtrace.replica.simulate import simulate
from otel_kvtrace.replica.threaded import replica_targets, run_threaded

CONFIGS = {
    "documented": ReplicaConfig(num_layers=6, num_shared_buffers=2, prefetch_layers=3, steps=2),
    "hol": ReplicaConfig(num_layers=8, num_shared_buffers=2, prefetch_layers=4, independent_layers=(0, 4), steps=2,
                         slow=SlowInjection(slow_save_layers=(1,), slow_save_us=2000)),
    "buckets": ReplicaConfig(num_layers=10, num_shared_buffers=2, prefetch_layers=3, bucket_pattern="ab", steps=2),
    "empty-steps": ReplicaConfig(num_layers=6, num_shared_buffers=2, prefetch_layers=3, requests_per_step=0, steps=2),
    "v0.23": ReplicaConfig(behaviour="v0.23", num_layers=6, prefetch_layers=3, steps=2),
    "key": ReplicaConfig(path="key", num_layers=6, prefetch_layers=2, steps=2),
    "partial-independent": ReplicaConfig(num_layers=8, num_shared_buffers=2, prefetch_layers=4,
                                         independent_layers=(0, 4), steps=2,
                                         timing=Timing(independent_load_fraction=0.0)),
    "slot-release": ReplicaConfig(num_layers=6, num_shared_buffers=2, prefetch_layers=3, steps=2,
                                  slow=SlowInjection(slow_slot_release_layers=(2,), slow_slot_release_us=1000)),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_threaded_and_virtual_engines_agree_on_order_gates_and_sources(name: str) -> None:
    cfg = CONFIGS[name]
    threaded = run_threaded(cfg)
    assert threaded.error is None and threaded.steps_done == cfg.steps
    gate_layer = {id(g): key for key, g in threaded.gates_by_layer.items()}
    got = [
        (e.step, e.layer_id, e.wait_for_save_layer, None if e.gate is None else gate_layer[id(e.gate)])
        for e in threaded.enqueue_log
    ]
    virtual = simulate(cfg)
    want = [(r.step, r.layer_id, r.wait_for_save_layer, None if r.gate_id is None else (r.step, r.gate_id))
            for r in virtual.recv]
    assert got == want
    # each task's gate is the one created by the wait_for_layer_load that enqueued it
    assert all(e.gate is None or e.gate is threaded.gates_by_layer[(e.step, e.current_layer)]
               for e in threaded.enqueue_log)


@pytest.mark.parametrize("name", ["documented", "v0.23", "key"])
def test_clean_shutdown_no_lost_task_done(name: str) -> None:
    before = {t.ident for t in threading.enumerate()}
    res = run_threaded(CONFIGS[name])
    assert res.clean_shutdown
    assert res.unfinished_tasks and all(v == 0 for v in res.unfinished_tasks.values())
    leftovers = [t for t in threading.enumerate() if t.ident not in before and t.name.startswith("KVCacheStore")]
    assert leftovers == []
    assert res.finished_requests == {"req-0", "req-1"}  # last chunks marked finished at the final layer


def test_final_layer_releases_leases_once_per_step() -> None:
    res = run_threaded(CONFIGS["hol"])
    assert len(res.lease_releases) == 2 and all(n == 8 for _t, n in res.lease_releases)


def test_main_recv_failure_propagates_to_the_forward() -> None:
    cfg = ReplicaConfig(num_layers=6, steps=3, slow=SlowInjection(fail_copy_at=(1, 3)))
    res = run_threaded(cfg, wait_timeout_s=0.05)
    assert isinstance(res.error, RuntimeError)
    assert "batch_copy failed for layer 3" in str(res.error.__cause__)
    assert res.steps_done == 1
    assert res.clean_shutdown  # the dead recv thread and the send thread are both gone
    assert res.unfinished_tasks["KVCacheStoreLayerRecvingThread"] > 0  # the failed item never got task_done


def test_v023_recv_failure_is_logged_and_the_run_completes(caplog) -> None:
    cfg = ReplicaConfig(behaviour="v0.23", num_layers=6, steps=3, slow=SlowInjection(fail_copy_at=(1, 3)))
    res = run_threaded(cfg)
    assert res.error is None and res.steps_done == 3
    assert any("batch_copy failed for layer 3" in r.getMessage() for r in caplog.records)
    assert all(v == 0 for v in res.unfinished_tasks.values())


def test_gate_first_record_wins_and_wait_times_out_without_record() -> None:
    npu = FakeNPU(RealClock())
    set_default_device(npu)
    gate = gate_module.reset_attention_compute_start_gate()
    assert gate_module.get_attention_compute_start_gate() is gate
    assert gate.wait(timeout=0.01) is False
    npu.compute.launch("attention", 1_000_000)
    gate_module.record_attention_compute_start()
    first = gate._event
    gate.record()
    assert gate._event is first  # later records are discarded
    assert gate.wait(timeout=1.0) is True
    assert first.query()  # wait returned only after the device passed the record point
    assert gate_module.reset_attention_compute_start_gate() is not gate


def test_replica_targets_are_the_upstream_shaped_classes() -> None:
    targets = replica_targets("v0.23")
    assert targets["worker_class"].__name__ == "KVPoolWorker"
    assert [c.__name__ for c in targets["recv_thread_classes"]] == [
        "KVCacheStoreLayerRecvingThread", "KVCacheStoreKeyLayerRecvingThread"]
    assert targets["gate_class"].__name__ == "AttentionComputeStartGate"
    assert targets["version"] == "replica-v0.23"
    for cls in targets["recv_thread_classes"]:
        for attr in ("add_request", "_handle_request", "run", "raise_if_failed"):
            assert callable(getattr(cls, attr))
    assert callable(targets["recv_thread_classes"][0]._batch_copy_with_limits)
    assert callable(targets["recv_thread_classes"][0]._stagger_h2d_submit)


@pytest.mark.parametrize("name", ["hol", "buckets", "slot-release", "empty-steps", "partial-independent"])
def test_device_timeline_never_reuses_a_buffer_early_or_crosses_the_attention_boundary(name: str) -> None:
    cfg = CONFIGS[name].with_(steps=3)
    npu = FakeNPU(RealClock(), keep_kernels=10_000)
    res = run_threaded(cfg, npu=npu)
    assert res.error is None
    n = cfg.num_layers
    spans = {}
    for stream in ("compute", "h2d", "d2h"):
        for (kind, index), start, end in npu.stream(stream).kernels:
            spans[(kind, index)] = (start, end)
    from otel_kvtrace.replica.layout import build_layout

    mapping = build_layout(cfg).prefetch_layer_map
    loads = [(i, se) for (kind, i), se in spans.items() if kind == "load"]
    assert len(loads) == len(res.enqueue_log) if cfg.requests_per_step else not loads
    gate_of = {(e.step, e.layer_id): e.current_layer for e in res.enqueue_log if e.gate is not None}
    for i, (start, _end) in loads:
        step, layer = divmod(i, n)
        src = mapping.get(layer)
        if src is not None:  # save-before-reuse: the previous occupant's D2H finished first
            assert start >= spans[("save", step * n + src)][1]
            assert start >= spans[("attention", step * n + src)][1]
        if (step, layer) in gate_of:  # attention boundary: device reached attention of the gate's layer
            assert start >= spans[("attention", step * n + gate_of[(step, layer)])][0]
    for step, (t_release, _keys) in enumerate(res.lease_releases):
        step_loads = [se[1] for i, se in loads if i // n == step]
        assert t_release >= max(step_loads)  # the final layer releases the leases after every copy


@pytest.mark.parametrize("behaviour", ["main", "v0.23"])
def test_run_loop_exception_semantics(behaviour: str) -> None:
    """main: the thread records _fatal_error and dies, later items stay queued; v0.23: logs, goes on."""
    from otel_kvtrace.replica.backend import FakeMStore, FakeTokenDatabase
    from otel_kvtrace.replica.kv_transfer import KVCacheStoreKeyLayerRecvingThread
    from otel_kvtrace.replica.metadata import LayerBlockRange, LayerLoadTask, LayerTransferTask, ReqMeta
    from otel_kvtrace.replica.plan import build_plan

    cfg = ReplicaConfig(path="key", behaviour=behaviour, num_layers=2, steps=1)
    plan = build_plan(cfg)
    npu = FakeNPU(RealClock())
    set_default_device(npu)
    loads = [threading.Event(), threading.Event()]
    saves = [threading.Event(), threading.Event()]
    ready = threading.Event()
    thread = KVCacheStoreKeyLayerRecvingThread(
        FakeMStore(plan, npu), FakeTokenDatabase(plan, npu), 128, 0, 1, 1, ready, threading.Event(), loads, saves, 2,
        behaviour=behaviour)
    thread.start()
    assert ready.wait(5)
    rng = [LayerBlockRange(ReqMeta("r", True, 2), 0, 2)]
    bad = LayerLoadTask(None, [LayerTransferTask(0, rng), LayerTransferTask(0, rng)], 0, None)  # >1 task: ValueError
    good = LayerLoadTask(None, [LayerTransferTask(1, rng)], 1, None)
    thread.add_request(bad)
    thread.add_request(good)
    if behaviour == "main":
        thread.join(5)
        assert not thread.is_alive()
        assert isinstance(thread._fatal_error, ValueError)
        with pytest.raises(RuntimeError) as info:
            thread.raise_if_failed()
        assert info.value.__cause__ is thread._fatal_error
        assert not loads[1].is_set() and thread.request_queue.qsize() == 1
    else:
        assert loads[1].wait(5)
        assert thread.is_alive() and thread._fatal_error is None
        thread.raise_if_failed()
        thread.stop()
        thread.join(5)
        assert not thread.is_alive()
        assert thread.request_queue.unfinished_tasks == 1  # v0.23 never task_done()s the failed item


def test_docs_name_the_number_of_layouts_this_agreement_test_checks() -> None:
    from pathlib import Path

    words = {6: "six", 7: "seven", 8: "eight", 9: "nine", 10: "ten", 11: "eleven", 12: "twelve"}
    doc = (Path(__file__).resolve().parents[2] / "docs" / "replica.md").read_text()
    assert f"checks this for {words[len(CONFIGS)]} layouts" in doc
