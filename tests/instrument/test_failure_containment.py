"""A bug inside the instrumentation turns tracing off (one log line) and never reaches the host threads:
the traced replica still runs every step, in the same order, with no lost task_done."""

from __future__ import annotations

import logging

import pytest

from otel_kvtrace.api import start_tracing
from otel_kvtrace.instrument.state import QueueState
from otel_kvtrace.record.model import TaskRecord
from otel_kvtrace.replica import ReplicaConfig, replica_targets
from otel_kvtrace.replica.threaded import run_threaded

CFG = ReplicaConfig(num_layers=6, num_shared_buffers=2, prefetch_layers=3, steps=4)


def _enqueue_order(result) -> list[tuple[int, int, int | None]]:
    return [(e.step, e.layer_id, e.wait_for_save_layer) for e in result.enqueue_log]


@pytest.mark.parametrize("where", ["save wait (recv thread)", "enqueue (forward thread)"])
def test_an_instrumentation_bug_disables_tracing_not_the_host(
        where: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    reference = run_threaded(CFG)
    calls = {"n": 0}

    def broken(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] >= 5:  # fail mid-run, after tracing worked for a while
            raise KeyError("instrumentation bug")

    # The hot path inlines its helpers, so the fault goes into a slot it reads: TaskRecord.deps (written
    # by the recv thread's save wait) or QueueState.enqueued (read by the forward's enqueue only).
    cls, name = (TaskRecord, "deps") if where.startswith("save wait") else (QueueState, "enqueued")
    slot = cls.__dict__[name]

    def read(obj):
        broken()
        return slot.__get__(obj, cls)

    monkeypatch.setattr(cls, name, property(read, slot.__set__), raising=True)
    session = start_tracing(replica_targets(CFG.behaviour), exporter=None, run_id="broken")
    with caplog.at_level(logging.ERROR, logger="otel_kvtrace"):
        try:
            result = run_threaded(CFG)
        finally:
            stats = session.shutdown()
    assert calls["n"] >= 5, "the injected fault never ran"
    assert result.error is None and result.clean_shutdown
    assert result.steps_done == CFG.steps
    assert all(n == 0 for n in result.unfinished_tasks.values())
    assert _enqueue_order(result) == _enqueue_order(reference)
    assert stats.disabled_reason is not None and "instrumentation bug" in stats.disabled_reason
    assert not session.recorder.enabled
    assert sum("tracing disabled" in r.getMessage() for r in caplog.records) == 1
