"""The instrumentation on the replica: same behaviour traced or not, and nothing left after uninstrument."""

from __future__ import annotations

import threading

import pytest

from otel_kvtrace.api import start_tracing
from otel_kvtrace.record.model import TaskKind, stage_triples
from otel_kvtrace.replica import fake_npu
from otel_kvtrace.replica.config import ReplicaConfig, SlowInjection, Timing
from otel_kvtrace.replica.fake_npu import FakeNPU, RealClock, set_default_device
from otel_kvtrace.replica.plan import build_plan
from otel_kvtrace.replica.pool_worker import KVPoolWorker
from otel_kvtrace.replica.simulate import simulate
from otel_kvtrace.replica.threaded import replica_targets, run_threaded

HOL = ReplicaConfig(num_layers=8, num_shared_buffers=2, prefetch_layers=4, independent_layers=(0, 4), steps=3,
                    slow=SlowInjection(slow_save_layers=(1,), slow_save_us=2000),
                    )


def _summary(res):
    gate_layer = {id(g): key for key, g in res.gates_by_layer.items()}
    order = [(e.step, e.layer_id, e.wait_for_save_layer, gate_layer.get(id(e.gate))) for e in res.enqueue_log]
    return (order, res.steps_done, type(res.error), res.finished_requests, len(res.lease_releases),
            res.unfinished_tasks, res.clean_shutdown)


def _class_snapshot() -> dict[tuple[type, str], object]:
    targets = replica_targets()
    classes = [targets["worker_class"], targets["gate_class"], *targets["recv_thread_classes"],
               *targets["send_thread_classes"]]
    return {(cls, name): value for cls in classes for name, value in vars(cls).items()}


def test_traced_and_untraced_runs_are_identical() -> None:
    plain = run_threaded(HOL)
    session = start_tracing(replica_targets(), resource=HOL.resource_attributes(), exporter=None, run_id="t-ident")
    try:
        traced = run_threaded(HOL)
    finally:
        session.shutdown()
    assert _summary(traced) == _summary(plain)
    records = session.recorder.drain(100_000)
    recv = sorted((r for r in records if r.kind == TaskKind.RECV), key=lambda r: r.seq)
    virtual = simulate(HOL)
    assert [(r.step, r.layer_id, r.wait_for_save_layer, r.gate_id) for r in recv] == [
        (r.step, r.layer_id, r.wait_for_save_layer, r.gate_id) for r in virtual.recv]


def test_failure_semantics_are_identical_when_traced() -> None:
    cfg = ReplicaConfig(num_layers=6, steps=3, slow=SlowInjection(fail_copy_at=(1, 3)))
    plain = run_threaded(cfg, wait_timeout_s=0.05)
    session = start_tracing(replica_targets(), exporter=None, run_id="t-fail")
    try:
        traced = run_threaded(cfg, wait_timeout_s=0.05)
    finally:
        session.shutdown()
    assert _summary(traced) == _summary(plain)
    assert str(traced.error.__cause__) == str(plain.error.__cause__)


def test_uninstrument_restores_every_class_attribute_and_instance_object() -> None:
    before = _class_snapshot()
    session = start_tracing(replica_targets(), exporter=None, run_id="t-undo")
    assert _class_snapshot() != before  # something was patched
    cfg = HOL.with_(timing=HOL.timing, slow=SlowInjection(slow_slot_release_layers=(2,), slow_slot_release_us=100))
    npu = FakeNPU(RealClock())
    set_default_device(npu)
    worker = KVPoolWorker(cfg, build_plan(cfg), npu)
    waiter = worker.external_slot_release_waiter
    worker.register_kv_caches()  # per-instance attach happens here
    try:
        session.shutdown()
        after = _class_snapshot()
        assert after.keys() == before.keys()
        assert all(after[k] is before[k] for k in before)
        recv = worker.kv_recv_thread
        for lst in (worker.layer_load_finished_events, worker.layer_save_finished_events):
            assert all(type(e) is threading.Event for e in lst)
            assert lst is recv.layer_load_finished_events or lst is recv.layer_save_finished_events
        assert all(type(e) is fake_npu.Event for e in worker.sync_save_events)
        assert recv.external_slot_release_waiter == waiter
        assert worker.external_slot_release_waiter == waiter
        for builder in recv.group_builders:
            assert type(builder).__name__ == "LayerBatchBuilder" and "build_addrs" not in vars(builder)
        assert "store" in vars(worker.m_store) and type(worker.m_store.store).__name__ == "FakeStoreClient"
        # no instance attribute left behind: same attribute names as a worker that was never traced
        plain = KVPoolWorker(cfg, build_plan(cfg), npu)
        plain.register_kv_caches()
        try:
            assert set(vars(worker)) == set(vars(plain))
            assert set(vars(recv)) == set(vars(plain.kv_recv_thread))
            assert set(vars(worker.kv_send_thread)) == set(vars(plain.kv_send_thread))
        finally:
            assert plain.shutdown()
    finally:
        assert worker.shutdown()


AGREEMENT = {
    "main-hol-slot": HOL.with_(steps=2, slow=SlowInjection(slow_slot_release_layers=(2,), slow_slot_release_us=200)),
    "main-empty": ReplicaConfig(num_layers=6, num_shared_buffers=2, prefetch_layers=3, requests_per_step=0, steps=2),
    # the forward arrives before the load finished, so it waits (a consumer wait). v0.23 and the key path
    # decide that from the task list, which the recv thread clears when the load finishes: a forward that
    # arrives later sees no task and does not wait at all (upstream behaviour, the "late-forward" cases).
    # 20 ms per load, so "before" holds on a loaded 2-core machine too (the default 0.4 ms did not: a
    # descheduled forward thread arrived after the load finished, about one run in three on 2 busy cores).
    "v0.23": ReplicaConfig(behaviour="v0.23", num_layers=6, prefetch_layers=3, steps=2,
                           timing=Timing(load_h2d_us_per_block=2500)),
    "key": ReplicaConfig(path="key", num_layers=6, prefetch_layers=2, steps=2,
                         timing=Timing(load_h2d_us_per_block=2500)),
    "partial-independent": HOL.with_(steps=2, timing=Timing(independent_load_fraction=0.25)),
    # the forward arrives after the load finished: the recv thread has cleared the task list, so no wait.
    # 20 ms of host launch per layer, so "after" holds on a loaded 2-core machine too (3 ms did not:
    # a descheduled recv thread finished a load after the forward arrived, about one run in three).
    "v0.23-late-forward": ReplicaConfig(behaviour="v0.23", num_layers=6, prefetch_layers=3, steps=2,
                                        timing=Timing(host_launch_us=20_000)),
    "key-late-forward": ReplicaConfig(path="key", num_layers=6, prefetch_layers=2, steps=2,
                                      timing=Timing(host_launch_us=20_000)),
    # main does not clear the task list: the late forward still waits, on an event already set, after the
    # recv thread dropped its hold; the consumer wait is then a zero-length stage, never lost.
    "main-late-forward": ReplicaConfig(num_layers=6, prefetch_layers=3, steps=2, timing=Timing(host_launch_us=20_000)),
    "stagger": ReplicaConfig(num_layers=6, prefetch_layers=3, tp_size=2, tp_rank=1, steps=2,
                             timing=Timing(h2d_stagger_us=200)),
}


def _shape(rec) -> tuple:
    from otel_kvtrace.record.model import Stage

    # a zero-length condition wait is timing noise (the record happened a few us before or after arrival)
    stages = tuple(int(s) for s, _a, _b in stage_triples(rec.stages) if s != Stage.GATE_COND_WAIT)
    return (stages, rec.has_dep, int(rec.outcome), rec.final_layer, rec.wait_for_save_layer, rec.gate_id)


@pytest.mark.parametrize("name", sorted(AGREEMENT))
def test_virtual_records_have_the_shape_of_instrumented_threaded_records(name: str) -> None:
    """Same stages in the same order, same dependencies, outcome and identity per (kind, step, layer)."""
    cfg = AGREEMENT[name]
    session = start_tracing(replica_targets(cfg.behaviour), exporter=None, npu_timing=True, run_id=f"t-{name}")
    try:
        assert run_threaded(cfg).error is None
    finally:
        session.shutdown()
    traced = {(r.kind, r.step, r.layer_id): r for r in session.recorder.drain(100_000)}
    virtual = simulate(cfg)
    simulated = {(r.kind, r.step, r.layer_id): r for r in virtual.recv + virtual.send}
    assert set(traced) == set(simulated)
    diffs = {k: (_shape(traced[k]), _shape(v)) for k, v in simulated.items() if _shape(traced[k]) != _shape(v)}
    assert diffs == {}
