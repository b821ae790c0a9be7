"""The output-ready watcher: outputs beyond MAX_PENDING are counted and reported, and polling backs off
toward MAX_POLL_S while nothing completes (each wake-up takes the GIL from the engine thread)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from otel_kvtrace.asynccheck import model as m
from otel_kvtrace.asynccheck import ready
from otel_kvtrace.asynccheck.export import AsyncTracer, default_resource
from otel_kvtrace.asynccheck.importers import import_otlp_json
from otel_kvtrace.asynccheck.recorder import StampBuffer, StampKind
from otel_kvtrace.record.recorder import ClockAnchor


class _CopyEvent:
    """Stands in for the NPU copy-ready event: ``query()`` is False until ``after`` queries were made."""

    def __init__(self, after: int) -> None:
        self.after = after
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.queries > self.after


class _Output:
    def __init__(self, event: _CopyEvent) -> None:
        self.async_copy_ready_event = event


def test_outputs_beyond_max_pending_are_counted_and_reach_the_check(tmp_path: Path) -> None:
    buffer = StampBuffer()
    watcher = ready.ReadyWatcher(buffer)
    try:
        for _ in range(ready.MAX_PENDING + 3):
            watcher.register(_Output(_CopyEvent(after=10**9)))  # never completes: the watcher falls behind
        assert (len(watcher.pending), buffer.outputs_dropped) == (ready.MAX_PENDING, 3)
    finally:
        watcher.stop()
    path = tmp_path / "w.jsonl"
    tracer = AsyncTracer(path=path, resource=default_resource(run_id="w", source="replica", label="w"),
                         buffer=buffer, anchor=ClockAnchor(0, 1_700_000_000_000_000_000))
    buffer.put(StampKind.DONE, 20, 1)  # a worker's get_output off the engine thread: one output_ready span
    tracer.shutdown()
    result = import_otlp_json(path, "w")
    warnings = [(w.kind, w.message) for w in result.warnings]
    assert [k for k, _ in warnings] == [m.WARN_OUTPUTS_DROPPED] and "dropped 3 outputs" in warnings[0][1]


def test_polling_backs_off_while_nothing_completes(monkeypatch: pytest.MonkeyPatch) -> None:
    delays: list[float] = []
    done = threading.Event()

    def sleep(seconds: float) -> None:  # the loop's own choice of delay is recorded, then it yields
        delays.append(seconds)
        time.sleep(0)

    monkeypatch.setattr(ready, "_sleep", sleep)
    buffer = StampBuffer()
    watcher = ready.ReadyWatcher(buffer)
    put = buffer.put
    monkeypatch.setattr(buffer, "put", lambda kind, *a: (put(kind, *a), done.set()))
    watcher.register(_Output(_CopyEvent(after=9)))  # the first query() is register()'s own
    try:
        assert done.wait(10)
    finally:
        watcher.stop()
    assert delays[:8] == pytest.approx([1e-4, 2e-4, 3e-4, 3e-4, 3e-4, 3e-4, 3e-4, 3e-4])
    assert max(delays) == ready.MAX_POLL_S
    assert [s.kind for s in buffer.drain(0)] == [StampKind.READY]


def test_an_output_already_ready_at_registration_is_stamped_there_without_the_watcher() -> None:
    """A launch that waited for the device records its copy event on an idle stream: ``register()``'s one
    ``query()`` sees it complete, so the ready time carries no watcher wake-up latency."""
    ticks = iter(range(1000, 10**6, 10))
    buffer = StampBuffer(clock=lambda: next(ticks))
    watcher = ready.ReadyWatcher(buffer)
    watcher.register(_Output(_CopyEvent(after=0)))
    assert watcher._thread is None and not watcher.pending
    (stamp,) = buffer.drain(0)
    assert (stamp.kind, stamp.t, stamp.a, stamp.b) == (StampKind.READY, 1010, 1000, 1000)


def test_an_output_behind_a_pending_one_waits_for_the_watcher_in_order() -> None:
    """Outputs complete in copy-stream order; one registered behind a pending output is never stamped first."""
    buffer = StampBuffer()
    watcher = ready.ReadyWatcher(buffer)
    try:
        watcher.register(_Output(_CopyEvent(after=10**9)))
        watcher.register(_Output(_CopyEvent(after=0)))
        assert len(watcher.pending) == 2
        assert buffer.drain(0) == []
    finally:
        watcher.stop()


def test_the_creating_call_brackets_an_output_that_completes_just_after_registration(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The short copy behind a launch that waited for the device completes just after ``register()``'s
    query. The worker call that created the output queries once more as it returns (``poke``), so the
    ready time is bracketed there, not at the watcher's next wake-up (50 ms late here, like a watcher
    thread the OS wakes late on a loaded machine)."""
    from otel_kvtrace.asynccheck.instrument import EngineLoopInstrumentation

    monkeypatch.setattr(ready, "_sleep", lambda seconds: time.sleep(0.05))

    class Output(_Output):
        def __init__(self, event: _CopyEvent) -> None:  # its own __init__: the patch point
            super().__init__(event)

    class Worker:
        def sample_tokens(self, grammar_output: object) -> Output:
            return Output(_CopyEvent(after=1))  # register()'s query: not yet; every later one: done

    buffer = StampBuffer()
    inst = EngineLoopInstrumentation(buffer, {"worker": (Worker,), "output": (Output,)})
    inst.install()
    stamps: list = []

    def call_and_wait_ready() -> None:
        Worker().sample_tokens(None)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not any(s.kind == StampKind.READY for s in stamps):
            time.sleep(0.001)
            stamps.extend(buffer.drain(0))

    try:
        call_and_wait_ready()  # starts the watcher, which then sleeps
        stamps.clear()
        call_and_wait_ready()
    finally:
        inst.uninstall()
    (call,) = [s for s in stamps if s.kind == StampKind.WORKER_CALL]
    (ready_stamp,) = [s for s in stamps if s.kind == StampKind.READY]
    # [last query false, first query true] lies inside the call: registered, then the call's own query
    assert call.t <= ready_stamp.a <= ready_stamp.t <= call.a, (call, ready_stamp)


def test_a_false_answer_held_up_behind_the_creating_calls_poke_never_inverts_the_bracket() -> None:
    """The watcher's ``query()`` answers "not yet", the copy completes, and the watcher gets the GIL back
    only after the creating thread's ``poke()`` saw it complete. The false answer holds from when the query
    began, so the stamp keeps last-false before first-true (a later clock would put the ready time after an
    observed completion)."""
    in_query, poked = threading.Event(), threading.Event()

    class HeldEvent:
        done = False
        watcher_calls = 0

        def query(self) -> bool:
            if threading.current_thread().name != "kvtrace-async-ready":
                return self.done
            self.watcher_calls += 1
            answer = self.done
            if self.watcher_calls == 1:
                self.done = True  # the copy completes right after the driver answered
                in_query.set()
                assert poked.wait(5)  # the watcher thread resumes only after the poke
            return answer

    buffer = StampBuffer()
    watcher = ready.ReadyWatcher(buffer)
    event = HeldEvent()
    watcher.pending.append((event, buffer.clock()))
    watcher.start()
    try:
        assert in_query.wait(5)
        watcher.poke()
        poked.set()
        deadline = time.monotonic() + 5
        stamps: list = []
        while time.monotonic() < deadline and not stamps:
            stamps = [s for s in buffer.drain(0) if s.kind == StampKind.READY]
            time.sleep(0.001)
    finally:
        watcher.stop()
    (stamp,) = stamps
    assert watcher.seen is not None and watcher.seen[2] and stamp.t == watcher.seen[1]
    assert stamp.b <= stamp.a <= stamp.t, stamp


def test_a_failing_poke_stops_the_watcher_as_its_message_says() -> None:
    class BrokenForPoke:
        def query(self) -> bool:
            if threading.current_thread().name != "kvtrace-async-ready":
                raise RuntimeError("driver error")
            return False

    buffer = StampBuffer()
    watcher = ready.ReadyWatcher(buffer)
    watcher.pending.append((BrokenForPoke(), buffer.clock()))
    watcher.start()
    try:
        watcher.poke()
        assert watcher.failed and not watcher.pending
        assert watcher._thread is not None
        watcher._thread.join(5)
        assert not watcher._thread.is_alive()
        watcher.register(_Output(BrokenForPoke()))
        assert not watcher.pending
    finally:
        watcher.stop()
