"""Stream-order upper bounds for NPU dependencies (no device timing): valid, and tight enough that a task
queued behind a blocked head is known to be ready before it is dequeued."""

from __future__ import annotations

import dataclasses

from otel_kvtrace.api import start_tracing
from otel_kvtrace.instrument.stream_order import StreamLog, StreamPosition
from otel_kvtrace.record.model import Dep, TaskKind
from otel_kvtrace.replica import replica_targets
from otel_kvtrace.replica.threaded import run_threaded
from otel_kvtrace.demo import PRESETS

MAPPING_TOLERANCE_NS = 300_000  # host<->device mapping error of the calibration (us range), generous


def test_stream_log_bounds_an_event_by_any_later_completion() -> None:
    log = StreamLog()
    gate, save, later = log.append(), log.append(), log.append()
    assert StreamPosition(log, gate).upper_bound() == 1 << 62
    log.observe(later, 900)
    log.observe(save, 950)
    assert StreamPosition(log, gate).upper_bound() == 900
    log.observe(gate, 800)
    assert StreamPosition(log, gate).upper_bound() == 800
    assert StreamPosition(log, later).upper_bound() == 900


def test_hol_preset_bounds_are_valid_and_beat_the_own_dequeue() -> None:
    cfg = dataclasses.replace(PRESETS["hol"], steps=20)
    session = start_tracing(replica_targets(cfg.behaviour), exporter=None, npu_timing=True, run_id="bounds")
    session.recorder.npu_resolver = None  # resolve by hand below: stream bound vs device truth
    try:
        assert run_threaded(cfg).error is None
    finally:
        session.shutdown()
    timing = session.runtime.npu_timing
    assert timing is not None
    records = [r for r in session.recorder.drain(100_000) if r.kind == TaskKind.RECV]
    checked = 0
    bypass_ready = behind = 0
    for rec in records:
        stream_hi = {dep: pos.upper_bound() for dep, pos in rec.npu_marks if isinstance(pos, StreamPosition)}
        exact = {dep: timing.device_time_ns(m) for dep, m in rec.npu_marks if not isinstance(m, StreamPosition)}
        for dep, hi in stream_hi.items():
            truth = exact.get(dep)
            assert truth is not None
            assert truth <= hi + MAPPING_TOLERANCE_NS, f"layer {rec.layer_id}: bound {hi} before the device {truth}"
            assert hi >= rec.dep_lo(dep), "an upper bound below the record (issue) time"
            checked += 1
        if rec.layer_id == 4 and Dep.GATE_NPU in stream_hi:  # independent layer queued behind layer 3
            behind += 1
            bypass_ready += stream_hi[Dep.GATE_NPU] < rec.t_dequeue
    assert checked > 100
    assert behind == 20
    assert bypass_ready >= 18, f"only {bypass_ready}/20 layer-4 tasks known ready before their dequeue"


def test_a_log_without_step_boundaries_stays_bounded() -> None:
    from types import SimpleNamespace

    from otel_kvtrace.instrument.stream_order import MAX_EVENTS_PER_LOG, next_position

    holder = SimpleNamespace(stream_log=StreamLog())
    first = holder.stream_log
    positions = [next_position(holder) for _ in range(MAX_EVENTS_PER_LOG + 10)]
    assert len(first.done_by) == MAX_EVENTS_PER_LOG
    assert holder.stream_log is not first and len(holder.stream_log.done_by) == 10
    positions[-1].log.observe(positions[-1].position, 5)
    assert positions[-1].upper_bound() == 5


def test_bounds_applied_at_completion_equal_bounds_applied_later() -> None:
    """The exporter agent applies stream bounds when a task is shipped (the serving process's log is not
    shared); the in-process exporter applies them at drain time. Same records, both ways: same bounds."""
    cfg = dataclasses.replace(PRESETS["hol"], steps=20)
    session = start_tracing(replica_targets(cfg.behaviour), exporter=None, run_id="bounds-early")
    resolve = session.runtime.resolve
    session.recorder.npu_resolver = None  # the drain must not resolve: we compare by hand
    early: dict[int, list[int]] = {}
    submit = session.recorder.submit

    def submit_and_resolve_a_copy(rec) -> None:  # what the ring path does at submit, on a shadow record
        shadow = dataclasses.replace(rec, deps=list(rec.deps), npu_marks=list(rec.npu_marks), stages=[], holds=[])
        resolve(shadow)
        early[id(rec)] = shadow.deps
        submit(rec)

    session.recorder.submit = submit_and_resolve_a_copy
    try:
        assert run_threaded(cfg).error is None
    finally:
        session.shutdown()
    records = session.recorder.drain(100_000)
    tightened = 0
    for rec in records:
        before = list(rec.deps)
        resolve(rec)  # late: after the whole run, every completion observed
        assert early[id(rec)] == rec.deps, f"{TaskKind(rec.kind).name} layer {rec.layer_id} step {rec.step}"
        tightened += before != rec.deps
    assert len(records) > 100 and tightened > 50


def test_the_resolver_scans_exactly_up_to_the_last_observed_event() -> None:
    """``Runtime.resolve`` reads only entries up to the last position seen complete (``StreamLog.observed``):
    the bound from the newest observation counts, unobserved entries after it never do."""
    from otel_kvtrace.instrument.runtime import Runtime
    from otel_kvtrace.record.model import TaskRecord
    from otel_kvtrace.record.recorder import Recorder

    rt = Runtime(recorder=Recorder(), run_id="window")
    log = StreamLog()
    positions = [log.append() for _ in range(6)]
    dep = int(Dep.GATE_NPU)

    def bound_of(p: int, hi: int, lo: int = 10) -> int:
        rec = TaskRecord()
        rec.dep_bounds(dep, lo, hi)
        rec.npu_marks.append((dep, StreamPosition(log, p)))
        rt.resolve(rec)
        assert not rec.npu_marks
        return rec.dep_hi(dep)

    assert bound_of(1, 1000) == 1000 and log.observed == -1  # nothing seen complete: untouched
    log.observe(positions[1], 900)
    assert bound_of(1, 1000) == 900 == StreamPosition(log, 1).upper_bound()  # its own observation
    assert bound_of(2, 1000) == 1000  # recorded after the last observed event: no bound from it
    log.observe(positions[4], 700)  # the newest observation, at the window's last entry
    assert log.observed == 4
    assert bound_of(1, 1000) == 700 == StreamPosition(log, 1).upper_bound()
    assert bound_of(4, 1000) == 700 and bound_of(5, 1000) == 1000
    assert bound_of(0, 1000, lo=800) == 800  # never below the dependency's lower bound


def test_the_npu_proxy_s_inlined_observe_equals_stream_log_observe() -> None:
    """``TracedNpuEvent.synchronize`` inlines ``StreamLog.observe`` (one frame less per NPU sync on the
    recv/send threads): over every order of completions, its log ends as the method's would."""
    import itertools
    from types import SimpleNamespace

    from otel_kvtrace.instrument.proxies import TracedNpuEvent

    class Event:
        def record(self) -> None:
            pass

        def synchronize(self) -> None:
            pass

    for order in itertools.permutations(range(4)):
        for stamps in ((10, 20, 30, 40), (40, 30, 20, 10), (25, 5, 25, 15)):
            now = itertools.count(1).__next__
            ticks: list[int] = []
            rt = SimpleNamespace(recorder=SimpleNamespace(clock=lambda: ticks.pop(0) if ticks else now()),
                                 state_by_thread={}, stream_log=StreamLog(), npu_timing=None)
            events = [TracedNpuEvent(Event(), rt, None) for _ in range(4)]  # type: ignore[arg-type]
            for ev in events:
                ev.record()
            reference = StreamLog()
            for _ in events:
                reference.append()
            for i, t1 in zip(order, stamps):
                ticks[:] = [t1 - 1, t1]  # synchronize's two clock reads
                events[i].synchronize()
                reference.observe(i, t1)
                assert (rt.stream_log.done_by, rt.stream_log.observed) == (reference.done_by, reference.observed)
