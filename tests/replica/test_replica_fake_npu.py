"""Fake NPU: stream timelines and torch-like event semantics on both clocks."""

from __future__ import annotations

import threading
import time

import pytest

from otel_kvtrace.replica.fake_npu import Event, FakeNPU, RealClock, VirtualClock


def test_kernels_queue_on_their_stream_and_events_complete_there() -> None:
    clock = VirtualClock(1_000)
    npu = FakeNPU(clock, keep_kernels=10)
    s = npu.current_stream()
    assert s.launch("attention", 500) == 1_500
    assert s.launch("compute", 200) == 1_700  # waits for the previous kernel
    ev = npu.Event()
    ev.record()  # captures everything launched so far
    assert not ev.query()
    other = npu.stream("h2d")
    assert other.launch("load", 100) == 1_100  # a different stream runs in parallel
    clock.sleep_until(1_699)
    assert not ev.query()
    ev.synchronize()
    assert clock.now_ns() == 1_700 and ev.query()
    assert [k[0] for k in s.kernels] == ["attention", "compute"]


def test_unrecorded_event_queries_true_and_synchronize_returns() -> None:
    npu = FakeNPU(VirtualClock())
    ev = npu.Event()
    assert ev.query()
    ev.synchronize()


def test_elapsed_time_needs_timing_recording_and_completion() -> None:
    clock = VirtualClock()
    npu = FakeNPU(clock)
    a, b = npu.Event(enable_timing=True), npu.Event(enable_timing=True)
    with pytest.raises(RuntimeError, match="recorded"):
        a.elapsed_time(b)
    a.record()
    npu.compute.launch("k", 2_000_000)
    b.record()
    with pytest.raises(RuntimeError, match="completed"):
        a.elapsed_time(b)
    b.synchronize()
    assert a.elapsed_time(b) == pytest.approx(2.0)
    plain = npu.Event()
    plain.record()
    with pytest.raises(RuntimeError, match="enable_timing"):
        a.elapsed_time(plain)


def test_real_clock_synchronize_blocks_until_device_time() -> None:
    npu = FakeNPU(RealClock())
    end = npu.compute.launch("k", 20_000_000)  # 20 ms
    ev = Event(device=npu)
    ev.record()
    assert ev.device_time_ns == end
    done = threading.Event()

    def waiter() -> None:
        ev.synchronize()
        done.set()

    t = threading.Thread(target=waiter)
    t.start()
    assert not done.is_set() or time.perf_counter_ns() >= end
    t.join(5)
    assert done.is_set() and time.perf_counter_ns() >= end and ev.query()
