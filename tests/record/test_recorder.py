"""The hot-path recorder: pooling, bounded hand-off, drop counting, failure containment."""

from __future__ import annotations

import threading

import pytest

from otel_kvtrace.record.model import NO_TIME, Dep, Stage, TaskRecord, correlation_id, trace_ids_for, QueueInfo, TaskKind
from otel_kvtrace.record.recorder import ClockAnchor, Recorder


def test_submit_is_bounded_and_counts_drops() -> None:
    rec = Recorder(capacity=3)
    for _ in range(10):
        rec.submit(rec.new_record())
    assert rec.pending == 3
    assert rec.dropped == 7
    assert rec.submitted == 3


def test_drain_is_fifo_and_recycle_reuses_reset_records() -> None:
    rec = Recorder(capacity=8)
    made = []
    for layer in range(5):
        r = rec.new_record()
        r.layer_id = layer
        r.stages.extend((Stage.BACKEND_SUBMIT, 1, 2))
        r.dep_exact(Dep.SAVE_CPU, 7)
        made.append(r)
        rec.submit(r)
    out = rec.drain(3)
    assert [r.layer_id for r in out] == [0, 1, 2]
    rec.recycle(out)
    reused = rec.new_record()
    assert reused in made[:3]
    assert reused.stages == [] and reused.has_dep == 0 and reused.deps[0] == NO_TIME
    assert reused.layer_id == 0 and reused.t_enqueue == NO_TIME


def test_pool_never_exceeds_capacity() -> None:
    rec = Recorder(capacity=2)
    rec.recycle([TaskRecord() for _ in range(10)])
    assert len(rec._pool) == 2


def test_concurrent_submitters_lose_no_count() -> None:
    rec = Recorder(capacity=1000)
    per_thread = 5000

    def produce() -> None:
        for _ in range(per_thread):
            rec.submit(rec.new_record())

    threads = [threading.Thread(target=produce) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert rec.submitted + rec.dropped == 4 * per_thread
    # check-then-append may overshoot by at most one record per concurrent thread
    assert rec.pending == rec.submitted <= 1000 + 4


def test_disable_is_idempotent_and_logs_once(caplog: pytest.LogCaptureFixture) -> None:
    rec = Recorder()
    rec.disable("boom")
    rec.disable("again")
    assert not rec.enabled
    assert rec.disabled_reason == "boom"
    assert sum("tracing disabled" in r.message for r in caplog.records) == 1


def test_npu_resolver_failure_keeps_the_record() -> None:
    rec = Recorder()

    def broken(_: TaskRecord) -> None:
        raise RuntimeError("device gone")

    rec.npu_resolver = broken
    r = rec.new_record()
    r.npu_marks.append((Dep.GATE_NPU, object()))
    rec.submit(r)
    assert rec.drain(10) == [r]


def test_anchor_maps_clock_to_epoch() -> None:
    ticks = iter([100, 300])
    anchor = ClockAnchor.take(lambda: next(ticks))
    assert anchor.clock_ns == 200
    assert anchor.to_epoch(250) - anchor.epoch_ns == 50


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="capacity"):
        Recorder(capacity=0)


def test_correlation_and_trace_ids_are_deterministic_and_distinct() -> None:
    q = QueueInfo(run_id="run", path="gva", thread_name="t", pid=1, tp=3)
    a = correlation_id(q, TaskKind.RECV, 2, 5)
    assert a == "run/dp0.pp0.tp3.pcp0.dcp0/gva/s2/l5"
    assert trace_ids_for(a) == trace_ids_for(a)
    others = {correlation_id(q, TaskKind.RECV, s, l) for s in range(4) for l in range(8)}
    others.add(correlation_id(q, TaskKind.SEND, 2, 5))
    assert len({trace_ids_for(c)[0] for c in others}) == len(others) == 33
