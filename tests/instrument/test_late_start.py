"""Tracing switched on after the worker already started its transfer threads (e.g. the README's API
example run late, or KVTraceInstrumentor.instrument() mid-run): the threads are adopted by the worker,
so steps, gate ids, consumer waits and ids come out as if tracing had been on from the start."""

from __future__ import annotations

from otel_kvtrace.api import start_tracing
from otel_kvtrace.record.model import Stage, TaskKind, correlation_id, stage_triples
from otel_kvtrace.replica import ReplicaConfig, replica_targets
from otel_kvtrace.replica.threaded import run_threaded


def test_tracing_started_between_steps_adopts_the_running_threads() -> None:
    cfg = ReplicaConfig(num_layers=6, num_shared_buffers=2, prefetch_layers=3, steps=3)
    sessions = []

    def start_after_first_step(step: int) -> None:
        if step == 0:
            sessions.append(start_tracing(replica_targets(cfg.behaviour), exporter=None, run_id="late"))

    try:
        result = run_threaded(cfg, on_step=start_after_first_step)
    finally:
        for s in sessions:
            s.shutdown()
    assert result.error is None and result.clean_shutdown
    records = sessions[0].recorder.drain(10_000)
    recv = sorted((r for r in records if r.kind == TaskKind.RECV), key=lambda r: r.seq)
    send = [r for r in records if r.kind == TaskKind.SEND]
    assert [(r.step, r.layer_id) for r in recv] == [(s, l) for s in range(2) for l in range(6)]
    assert [r.seq for r in recv] == list(range(12)), "seq follows the FIFO from tracing start"
    ids = [correlation_id(r.queue, r.kind, r.step, r.layer_id) for r in records]
    assert len(ids) == len(set(ids)), "no two tasks share a correlation (trace) id"
    assert sorted((r.step, r.layer_id) for r in send) == [(s, l) for s in range(2) for l in range(6)]
    for r in recv:
        assert Stage.CONSUMER_WAIT in r.stages[0::3], f"layer {r.layer_id}: the forward's wait is missing"
    # P=3: at c=0 layers 1, 2 get G0; then layer c+2 gets G(c) (the forward layer that created it)
    gates = {r.layer_id: r.gate_id for r in recv if r.step == 1}
    assert gates == {0: None, 1: 0, 2: 0, 3: 1, 4: 2, 5: 3}
    assert all(r.queue.tp == 0 and r.queue.run_id == "late" for r in recv)
    assert all(len(list(stage_triples(r.stages))) > 0 for r in send)


def test_a_task_queued_before_tracing_runs_untraced_and_is_counted() -> None:
    from types import SimpleNamespace

    from otel_kvtrace.instrument.targets import Targets

    class RecvThread:  # the smallest upstream-shaped FIFO: add_request / _handle_request
        def __init__(self) -> None:
            self.queue: list = []

        def add_request(self, item) -> None:
            self.queue.append(item)

        def _handle_request(self, item) -> str:
            return f"handled {item.layer_id}"

    def task(layer: int) -> SimpleNamespace:
        return SimpleNamespace(layer_id=layer, wait_for_save_layer=None, attention_start_gate=None,
                               transfer_tasks=[])

    thread = RecvThread()
    thread.add_request(task(0))  # before tracing
    session = start_tracing(Targets(recv_thread_classes=(RecvThread,)), exporter=None, run_id="pre")
    try:
        thread.add_request(task(1))
        assert [thread._handle_request(t) for t in thread.queue] == ["handled 0", "handled 1"]
    finally:
        stats = session.shutdown()
    assert stats.untraced == 1
    assert stats.submitted == 1
    (record,) = session.recorder.drain(10)
    assert record.layer_id == 1 and record.seq == 0
