"""Records recorded by the instrumented replica, shipped through the ring as the serving process ships
them (``RingWriter.write_task`` on the raw record: NPU marks, upstream transfer tasks and all), decoded
by the agent: every field arrives, the stream-order bounds equal the resolver's before the ring moved
them into the write (fabdfbd's ``Runtime.resolve``, kept below as the reference) on the captured stream
logs, and the spans equal those of the in-process (thread) exporter path for the same records."""

from __future__ import annotations

import copy
import dataclasses
import os
from typing import Any

import pytest

from otel_kvtrace.api import start_tracing
from otel_kvtrace.demo import PRESETS
from otel_kvtrace.export.agent import Decoder
from otel_kvtrace.export.spans import SpanBuilder, summarize_transfer_tasks
from otel_kvtrace.instrument.stream_order import MAX_SCAN, StreamPosition
from otel_kvtrace.record import ring as R
from otel_kvtrace.record.model import TaskRecord
from otel_kvtrace.record.recorder import Recorder
from otel_kvtrace.replica import replica_targets
from otel_kvtrace.replica.threaded import run_threaded


def reference_resolve(record: TaskRecord) -> None:
    """The stream-order part of ``Runtime.resolve`` as it was at fabdfbd (before ``tighten_bounds``)."""
    deps = record.deps
    for dep, mark in record.npu_marks:
        if type(mark) is StreamPosition:
            p = mark.position
            log = mark.log
            last = log.observed
            if p >= last:
                if p > last:
                    continue
                bound = log.done_by[p]
            else:
                bound = min(log.done_by[p : last + 1 if last < p + MAX_SCAN else p + MAX_SCAN])
            lo = deps[2 * dep]
            if bound < deps[2 * dep + 1]:
                record.has_dep |= 1 << dep
                deps[2 * dep + 1] = bound if bound > lo else lo
    record.npu_marks.clear()


@pytest.fixture(scope="module")
def recorded() -> tuple[list[TaskRecord], Any, Any]:
    """The hol preset's records, unresolved (marks kept), with the stream logs as the run left them."""
    cfg = dataclasses.replace(PRESETS["hol"], steps=10)
    session = start_tracing(replica_targets(cfg.behaviour), exporter=None, run_id="ring-roundtrip")
    session.recorder.npu_resolver = None  # keep the marks: each path below tightens on its own
    try:
        assert run_threaded(cfg).error is None
    finally:
        session.shutdown()
    records = session.recorder.drain(100_000)
    assert len(records) > 100
    return records, session.runtime, session.recorder.anchor


def _copy(rec: TaskRecord) -> TaskRecord:
    return dataclasses.replace(rec, stages=list(rec.stages), deps=list(rec.deps), npu_marks=list(rec.npu_marks),
                               holds=[], transfer_tasks=copy.copy(rec.transfer_tasks))


def _ring() -> tuple[R.RingWriter, R.RingReader, Decoder]:
    """A fresh 4,096-slot ring: the serving process's writer, the agent's reader and decoder."""
    fd, mem = R.create_memfd(4096)
    os.close(fd)
    return R.RingWriter(mem), R.RingReader(mem), Decoder()


def _ship(records: list[TaskRecord]) -> list[TaskRecord]:
    writer, reader, decoder = _ring()
    out: list[TaskRecord] = []
    for rec in records:
        assert writer.write_task(rec, False)
        for msg in reader.poll(100):
            decoder.feed(msg, out)
        reader.consumed()
    assert decoder.undecodable == 0
    return out


def test_every_field_round_trips_and_bounds_equal_the_reference_resolver(recorded) -> None:
    records, runtime, _anchor = recorded
    reference = [_copy(r) for r in records]
    for rec in reference:
        reference_resolve(rec)
    decoded = _ship([_copy(r) for r in records])
    assert len(decoded) == len(records)
    tightened = 0
    for ref, raw, got in zip(reference, records, decoded):
        tightened += ref.deps != raw.deps
        assert got.deps == ref.deps and got.has_dep == ref.has_dep, f"seq {raw.seq} layer {raw.layer_id}"
        for name in ("kind", "seq", "step", "layer_id", "final_layer", "wait_for_save_layer", "gate_id",
                     "queue_depth_at_enqueue", "inflight_at_enqueue", "t_enqueue", "t_dequeue", "t_backend_return",
                     "t_complete", "stages", "outcome", "nbytes", "backend_result", "consumer_release"):
            assert getattr(got, name) == getattr(raw, name), name
        assert got.queue == raw.queue
        want = summarize_transfer_tasks(raw.transfer_tasks)
        assert (got.transfer_tasks.group_ids, got.transfer_tasks.request_ids, got.transfer_tasks.num_blocks) == (
            want.group_ids, want.request_ids, want.num_blocks)
    assert tightened > 50, "the run gave the bounds nothing to tighten: the comparison would be empty"


def test_the_agent_path_builds_the_thread_paths_spans(recorded) -> None:
    records, runtime, anchor = recorded
    thread_path = [_copy(r) for r in records]
    for rec in thread_path:
        runtime.resolve(rec)  # what the in-process exporter's drain does (Recorder.npu_resolver)
    agent_path = _ship([_copy(r) for r in records])
    builder = SpanBuilder(anchor)
    for mine, theirs in zip(agent_path, thread_path):
        assert builder.build_json(mine) == builder.build_json(theirs)


def test_a_full_ring_counts_every_task_it_could_not_take(recorded) -> None:
    """Nobody drains: the ring takes what fits, the recorder counts the rest, the header says so, and
    what was written decodes to exactly the submitted tasks (recorded == submitted + dropped)."""
    records, _runtime, _anchor = recorded
    fd, mem = R.create_memfd(R.CLAIM_MARGIN + 40)
    os.close(fd)
    writer, reader = R.RingWriter(mem), R.RingReader(mem)
    recorder = Recorder(capacity=10)
    recorder.attach_ring(writer)
    for rec in records[:100]:
        recorder.submit(_copy(rec))
    assert 0 < recorder.submitted < 100
    assert recorder.submitted + recorder.dropped == 100
    assert writer.hdr[R.H_DROPPED] == recorder.dropped
    out: list[TaskRecord] = []
    decoder = Decoder()
    for msg in reader.poll(1000):
        decoder.feed(msg, out)
    assert len(out) == recorder.submitted and decoder.undecodable == 0


def test_the_awaiting_bound_exports_the_oldest_flagged_and_counts_late_waits(recorded, monkeypatch) -> None:
    """At ``MAX_AWAITING`` tasks awaiting their consumer wait the agent exports the oldest without it, flagged
    ``agent_bound`` (never as if waited), and counts a consumer wait that comes after its task went."""
    from otel_kvtrace.export import agent
    from otel_kvtrace.record.model import CONSUMER_RELEASE_NAMES, Stage

    monkeypatch.setattr(agent, "MAX_AWAITING", 3)
    records, _runtime, _anchor = recorded
    sent = [_copy(rec) for rec in records[:5]]
    for rec in sent:  # as shipped before the forward waited: no consumer wait yet
        rec.stages[:] = agent._without_consumer_wait(rec.stages)
    writer, reader, decoder = _ring()
    out: list[TaskRecord] = []
    for rec in sent:
        assert writer.write_task(rec, True)
    wait = [int(Stage.CONSUMER_WAIT), 10, 20]
    assert writer.write_cwait(sent[0], R.REASON_WAITED, wait)  # its task was exported at the bound: late
    assert writer.write_cwait(sent[4], R.REASON_WAITED, wait)  # still awaiting: completed with it
    for msg in reader.poll(100):
        decoder.feed(msg, out)
    assert [r.seq for r in out] == [sent[0].seq, sent[1].seq, sent[4].seq]
    assert [CONSUMER_RELEASE_NAMES[r.consumer_release] for r in out] == ["agent_bound", "agent_bound", ""]
    assert out[2].stages[-3:] == wait and wait[0] not in out[0].stages[::3]
    assert decoder.bound_released == 2 and decoder.orphan_waits == 1 and len(decoder.awaiting) == 2
    spans = SpanBuilder(_anchor).build(out[0])
    attrs = {a["key"]: a["value"] for s in spans for a in s.get("attributes", ())}
    assert attrs.get("kvtrace.consumer_wait_missing") == {"stringValue": "agent_bound"}
