"""Span building: tree shape, names, attribute values, times, ids, links, errors (docs/schema.md)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from export_records import ANCHOR, QUEUE, T0, FakeBlockRange, FakeLayerTransferTask, FakeReq, FakeShared

from otel_kvtrace.export.encode import (
    resource_json,
    resource_text,
    spans_to_json_line,
    spans_to_request,
    texts_to_json_line,
    texts_to_spans,
)
from otel_kvtrace.export.otlp_json import json_line_to_request
from otel_kvtrace.export.spans import SpanBuilder, build_task_spans, child_span_ids, summarize_transfer_tasks
from otel_kvtrace.record.model import (
    stage_triples,
    ALL_CHILD_SPAN_NAMES,
    NO_TIME,
    RECV_ROOT_SPAN,
    SEND_ROOT_SPAN,
    Dep,
    Outcome,
    Stage,
    TaskKind,
    TaskRecord,
    correlation_id,
    trace_ids_for,
)

EPOCH = ANCHOR.epoch_ns


def _attrs(span: dict[str, Any]) -> dict[str, Any]:
    """Plain Python values of a JSON span's attributes."""

    def plain(value: dict[str, Any]) -> Any:
        kind, v = next(iter(value.items()))
        if kind == "intValue":
            return int(v)
        if kind == "arrayValue":
            return [plain(x) for x in v.get("values", [])]
        return v

    return {a["key"]: plain(a["value"]) for a in span.get("attributes", [])}


def _by_name(spans: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {s["name"]: s for s in spans}


def _t(span: dict[str, Any]) -> tuple[int, int]:
    return int(span["startTimeUnixNano"]), int(span["endTimeUnixNano"])


def test_tree_shape_and_names(make_record: Callable[..., TaskRecord]) -> None:
    spans = build_task_spans(make_record(), ANCHOR)
    root, children = spans[0], spans[1:]
    assert root["name"] == RECV_ROOT_SPAN
    assert "parentSpanId" not in root
    assert [c["name"] for c in children] == list(ALL_CHILD_SPAN_NAMES)  # every stage happened once or more
    trace_id, root_id = trace_ids_for(correlation_id(QUEUE, TaskKind.RECV, 2, 5))
    assert {s["traceId"] for s in spans} == {trace_id.hex()}
    assert root["spanId"] == root_id.hex()
    assert {c["parentSpanId"] for c in children} == {root_id.hex()}
    assert len({s["spanId"] for s in spans}) == len(spans)
    assert all(s["kind"] == 1 for s in spans)


def test_absent_stages_have_no_span(make_record: Callable[..., TaskRecord]) -> None:
    rec = make_record(src_layer=None, gate_id=None, consumer_wait=False)
    names = [s["name"] for s in build_task_spans(rec, ANCHOR)]
    for absent in ("save_cpu_wait", "save_npu_sync", "gate_cond_wait", "gate_npu_sync", "consumer_wait"):
        assert absent not in names
    root = _attrs(build_task_spans(rec, ANCHOR)[0])
    assert "kvtrace.wait_for_save_layer" not in root and "kvtrace.gate_id" not in root
    assert "kvtrace.ts.dep.save_cpu" not in root


def test_root_attribute_values(make_record: Callable[..., TaskRecord]) -> None:
    rec = make_record()
    root = _attrs(build_task_spans(rec, ANCHOR)[0])
    assert root["kvtrace.correlation_id"] == "run42/dp0.pp0.tp1.pcp0.dcp0/gva/s2/l5"
    assert root["kvtrace.path"] == "gva"
    assert root["kvtrace.queue"] == "run42/dp0.pp0.tp1.pcp0.dcp0/pid1234/KVCacheRecvThread"
    assert (root["kvtrace.seq"], root["kvtrace.step"], root["kvtrace.layer_id"]) == (3, 2, 5)
    assert root["kvtrace.final_layer"] is False
    assert root["kvtrace.group_ids"] == [0, 1]
    assert root["kvtrace.request_ids"] == ["reqA", "reqB", "reqC"]
    assert root["kvtrace.num_blocks"] == 4 + 3 + 2  # shared block ids + two block ranges
    assert root["kvtrace.bytes"] == 1 << 20
    assert root["kvtrace.wait_for_save_layer"] == 3
    assert root["kvtrace.gate_id"] == 4
    assert root["kvtrace.queue_depth_at_enqueue"] == 2
    assert root["kvtrace.inflight_at_enqueue"] == 3
    assert root["kvtrace.outcome"] == "ok"
    assert root["kvtrace.ts.enqueue"] == EPOCH + rec.t_enqueue
    assert root["kvtrace.ts.dequeue"] == EPOCH + rec.t_dequeue
    assert root["kvtrace.ts.complete"] == EPOCH + rec.t_complete


def test_bounded_dependencies(make_record: Callable[..., TaskRecord]) -> None:
    rec = make_record(bounded_npu=True)
    root = _attrs(build_task_spans(rec, ANCHOR)[0])
    assert root["kvtrace.ready_precision"] == "bounded"
    assert "kvtrace.ts.dep.save_npu" not in root
    assert root["kvtrace.ts.dep.save_npu_lo"] == EPOCH + rec.dep_lo(Dep.SAVE_NPU)
    assert root["kvtrace.ts.dep.save_npu_hi"] == EPOCH + rec.dep_hi(Dep.SAVE_NPU)
    assert root["kvtrace.ts.dep.save_cpu"] == EPOCH + rec.dep_lo(Dep.SAVE_CPU)
    his = [rec.dep_hi(d) for d in Dep if rec.has_dep >> d & 1] + [rec.t_enqueue]
    los = [rec.dep_lo(d) for d in Dep if rec.has_dep >> d & 1] + [rec.t_enqueue]
    assert root["kvtrace.ts.ready"] == EPOCH + max(his)
    assert root["kvtrace.ts.ready_lo"] == EPOCH + max(los)


def test_bounded_ready_differs_when_npu_upper_bound_is_latest(make_record: Callable[..., TaskRecord]) -> None:
    rec = make_record(bounded_npu=True)
    rec.dep_bounds(Dep.GATE_NPU, T0 + 10, T0 + 900_000)  # the latest upper bound of all
    root = _attrs(build_task_spans(rec, ANCHOR)[0])
    assert root["kvtrace.ts.ready"] == EPOCH + T0 + 900_000
    assert root["kvtrace.ts.ready_lo"] < root["kvtrace.ts.ready"]


def test_exact_dependencies(make_record: Callable[..., TaskRecord]) -> None:
    rec = make_record(bounded_npu=False)
    root = _attrs(build_task_spans(rec, ANCHOR)[0])
    assert root["kvtrace.ready_precision"] == "exact"
    assert "kvtrace.ts.ready_lo" not in root
    assert not any(k.endswith(("_lo", "_hi")) for k in root)
    for dep, name in zip(Dep, ("save_cpu", "save_npu", "gate_record", "gate_npu", "slot_release"), strict=True):
        assert root[f"kvtrace.ts.dep.{name}"] == EPOCH + rec.dep_lo(dep)
    assert root["kvtrace.ts.ready"] == EPOCH + max(rec.dep_hi(d) for d in Dep)


def test_no_dependencies_ready_is_enqueue(make_record: Callable[..., TaskRecord]) -> None:
    rec = make_record(src_layer=None, gate_id=None)
    rec.has_dep = 0
    root = _attrs(build_task_spans(rec, ANCHOR)[0])
    assert root["kvtrace.ts.ready"] == EPOCH + rec.t_enqueue
    assert root["kvtrace.ready_precision"] == "exact"


def test_child_attributes_and_derived_spans(make_record: Callable[..., TaskRecord]) -> None:
    rec = make_record(save_cpu_calls=3)
    spans = _by_name(build_task_spans(rec, ANCHOR))
    TASK = {"kvtrace.path": "gva", "kvtrace.task": "recv"}  # on every child span
    assert _attrs(spans["queue_wait"]) == {**TASK, "kvtrace.queue_depth_at_enqueue": 2}
    assert _t(spans["queue_wait"]) == (EPOCH + rec.t_enqueue, EPOCH + rec.t_dequeue)
    assert _t(spans["completion"]) == (EPOCH + rec.t_backend_return, EPOCH + rec.t_complete)
    assert _attrs(spans["save_cpu_wait"]) == {**TASK, "kvtrace.src_layer": 3, "kvtrace.calls": 3}
    assert _attrs(spans["save_npu_sync"]) == {**TASK, "kvtrace.src_layer": 3}
    assert _attrs(spans["gate_cond_wait"]) == {**TASK, "kvtrace.gate_id": 4}
    assert _attrs(spans["gate_npu_sync"]) == {**TASK, "kvtrace.gate_id": 4}
    assert _attrs(spans["meta_build"]) == {**TASK, "kvtrace.calls": 2}
    assert _attrs(spans["backend_submit"]) == {**TASK, "kvtrace.bytes": 1 << 20, "kvtrace.result": 0}
    assert _attrs(spans["consumer_wait"]) == {**TASK, "kvtrace.thread": "forward"}
    assert _attrs(spans["h2d_stagger"]) == TASK
    assert _attrs(spans["completion"]) == TASK


def test_repeated_stage_is_one_span_first_start_to_last_end(make_record: Callable[..., TaskRecord]) -> None:
    rec = make_record(save_cpu_calls=4)
    waits = [(s, e) for st, s, e in stage_triples(rec.stages) if st == Stage.SAVE_CPU_WAIT]
    assert len(waits) == 4
    span = _by_name(build_task_spans(rec, ANCHOR))["save_cpu_wait"]
    assert _t(span) == (EPOCH + waits[0][0], EPOCH + waits[-1][1])


def test_single_call_has_no_calls_attribute(make_record: Callable[..., TaskRecord]) -> None:
    span = _by_name(build_task_spans(make_record(save_cpu_calls=1), ANCHOR))["save_cpu_wait"]
    assert "kvtrace.calls" not in _attrs(span)


def test_times_monotone_and_inside_root(make_record: Callable[..., TaskRecord]) -> None:
    rec = make_record()
    spans = build_task_spans(rec, ANCHOR)
    root_start, root_end = _t(spans[0])
    assert root_start == EPOCH + rec.t_enqueue
    assert root_end == max(_t(s)[1] for s in spans[1:])  # root end = latest child end
    for span in spans[1:]:
        start, end = _t(span)
        assert root_start <= start <= end <= root_end, span["name"]
    # the recv thread's own stages do not overlap and run in order
    recv_thread = [s for s in spans[1:] if s["name"] not in ("consumer_wait",)]
    for before, after in zip(recv_thread, recv_thread[1:], strict=False):
        assert _t(before)[1] <= _t(after)[0], (before["name"], after["name"])


def test_stamps_use_the_clock_anchor(make_record: Callable[..., TaskRecord]) -> None:
    from otel_kvtrace.record.recorder import ClockAnchor

    rec = make_record()
    shifted = ClockAnchor(clock_ns=1_000, epoch_ns=EPOCH + 5_000)
    a = build_task_spans(rec, ANCHOR)
    b = build_task_spans(rec, shifted)
    assert _t(b[0])[0] - _t(a[0])[0] == 4_000


def test_ids_are_deterministic(make_record: Callable[..., TaskRecord]) -> None:
    rec = make_record()
    first = build_task_spans(rec, ANCHOR)
    again = SpanBuilder(ANCHOR).build(make_record())
    assert first == again
    other = build_task_spans(make_record(layer_id=6), ANCHOR)
    assert other[0]["traceId"] != first[0]["traceId"]
    assert {s["spanId"] for s in other}.isdisjoint({s["spanId"] for s in first})


def test_child_ids_follow_documented_derivation() -> None:
    corr = "run/dp0.pp0.tp0.pcp0.dcp0/gva/s0/l0"
    raw = hashlib.shake_128(b"kvtrace-child/" + corr.encode()).digest(8 * len(ALL_CHILD_SPAN_NAMES))
    assert child_span_ids(corr) == [raw[i : i + 8].hex() for i in range(0, len(raw), 8)]


def test_save_cpu_wait_links_to_producer_save_root(make_record: Callable[..., TaskRecord]) -> None:
    spans = build_task_spans(make_record(src_layer=3), ANCHOR)
    producer_trace, producer_root = trace_ids_for(correlation_id(QUEUE, TaskKind.SEND, 2, 3))
    (link,) = _by_name(spans)["save_cpu_wait"]["links"]
    assert link == {"traceId": producer_trace.hex(), "spanId": producer_root.hex()}
    # ... and it is exactly the root of the producer's own trace when that task is exported
    producer = build_task_spans(make_record(kind=TaskKind.SEND, layer_id=3, src_layer=None, gate_id=None), ANCHOR)
    assert (producer[0]["traceId"], producer[0]["spanId"]) == (link["traceId"], link["spanId"])
    assert "links" not in spans[0]  # links live on children, not the root


def test_send_task_root_name(make_record: Callable[..., TaskRecord]) -> None:
    rec = make_record(kind=TaskKind.SEND, src_layer=None, gate_id=None, consumer_wait=False)
    root = build_task_spans(rec, ANCHOR)[0]
    assert root["name"] == SEND_ROOT_SPAN
    assert _attrs(root)["kvtrace.correlation_id"].endswith("/gva-save/s2/l5")


def test_error_outcome_sets_status_and_exception_event(make_record: Callable[..., TaskRecord]) -> None:
    try:
        raise RuntimeError("batch_copy failed: 7")
    except RuntimeError as exc:
        error = exc
    rec = make_record(outcome=Outcome.ERROR, error=error)
    root = build_task_spans(rec, ANCHOR)[0]
    assert root["status"] == {"code": 2, "message": "RuntimeError: batch_copy failed: 7"}
    (event,) = root["events"]
    assert event["name"] == "exception"
    assert int(event["timeUnixNano"]) == EPOCH + rec.t_complete
    ev = _attrs(event)
    assert ev["exception.type"] == "RuntimeError"
    assert ev["exception.message"] == "batch_copy failed: 7"
    assert "raise RuntimeError" in ev["exception.stacktrace"]
    assert _attrs(root)["kvtrace.outcome"] == "error"


def test_ok_outcome_has_unset_status(make_record: Callable[..., TaskRecord]) -> None:
    root = build_task_spans(make_record(), ANCHOR)[0]
    assert root["status"] == {} and "events" not in root


def test_empty_task_without_backend(make_record: Callable[..., TaskRecord]) -> None:
    rec = TaskRecord(queue=QUEUE, seq=1, step=0, layer_id=2, outcome=Outcome.EMPTY)
    rec.t_enqueue, rec.t_dequeue, rec.t_complete = T0, T0 + 100, T0 + 300
    rec.stages.extend((Stage.SLOT_RELEASE_WAIT, T0 + 150, T0 + 250))
    spans = build_task_spans(rec, ANCHOR)
    assert [s["name"] for s in spans] == [RECV_ROOT_SPAN, "queue_wait", "slot_release_wait"]
    assert _t(spans[0]) == (EPOCH + T0, EPOCH + T0 + 300)  # root still covers the completion stamp
    root = _attrs(spans[0])
    assert root["kvtrace.outcome"] == "empty"
    assert root["kvtrace.group_ids"] == [] and root["kvtrace.request_ids"] == [] and root["kvtrace.num_blocks"] == 0


def test_missing_enqueue_uses_earliest_stamp() -> None:
    rec = TaskRecord(queue=QUEUE)
    rec.t_dequeue = T0 + 100
    rec.stages.extend((Stage.BACKEND_SUBMIT, T0 + 200, T0 + 400))
    rec.stages.extend((Stage.META_BUILD, T0 + 150, NO_TIME))  # end never stamped (raised mid-stage)
    spans = _by_name(build_task_spans(rec, ANCHOR))
    assert _t(spans[RECV_ROOT_SPAN]) == (EPOCH + T0 + 150, EPOCH + T0 + 400)
    assert _t(spans["meta_build"]) == (EPOCH + T0 + 150, EPOCH + T0 + 150)
    assert "queue_wait" not in spans


def test_transfer_summary_is_defensive() -> None:
    class Weird:
        group_id = "x"  # not an int: ignored
        shared_block_data = object()  # no req_ids / block_ids_arr
        block_ranges = None

    assert summarize_transfer_tasks(None).num_blocks == 0
    summary = summarize_transfer_tasks([Weird(), object(), 42])
    assert (summary.group_ids, summary.request_ids, summary.num_blocks) == ([], [], 0)
    single = FakeLayerTransferTask(
        group_id=2, layer_idx_in_group=0, block_ranges=[FakeBlockRange(FakeReq("r1"), 4, 9)]
    )
    summary = summarize_transfer_tasks(single)  # a bare task instead of a list
    assert (summary.group_ids, summary.request_ids, summary.num_blocks) == ([2], ["r1"], 5)
    shared = FakeShared(req_ids=[7, 7], block_ids_arr=[1, 2], is_last_chunks=[True], load_keys=[])
    summary = summarize_transfer_tasks([FakeLayerTransferTask(0, 0, shared_block_data=shared)])
    assert (summary.request_ids, summary.num_blocks) == (["7"], 2)


def test_transfer_summary_reads_numpy_fields() -> None:
    import numpy as np

    shared = FakeShared(
        req_ids=np.array(["r1", "r2", "r1"]), block_ids_arr=np.arange(6), is_last_chunks=[], load_keys=[]
    )
    ranged = FakeLayerTransferTask(
        group_id=np.int64(3),  # type: ignore[arg-type]
        layer_idx_in_group=0,
        block_ranges=[FakeBlockRange(FakeReq("r3"), np.int64(2), np.int64(5))],  # type: ignore[arg-type]
    )
    summary = summarize_transfer_tasks([FakeLayerTransferTask(1, 0, shared_block_data=shared), ranged])
    assert (summary.group_ids, summary.request_ids, summary.num_blocks) == ([1, 3], ["r1", "r2", "r3"], 9)


def test_unreadable_transfer_task_does_not_raise() -> None:
    class Exploding:
        group_id = 5

        @property
        def shared_block_data(self) -> object:
            raise RuntimeError("cleared by upstream")

    summary = summarize_transfer_tasks([Exploding(), FakeLayerTransferTask(2, 0)])
    assert summary.group_ids == [2, 5] and summary.num_blocks == 0


def test_encoders_agree_and_round_trip(make_record: Callable[..., TaskRecord]) -> None:
    """Text line, dict line and direct protobuf are one request (one span model, three encodings)."""
    records = [make_record(), make_record(layer_id=6, outcome=Outcome.ERROR, error=ValueError('quote " and \u00e9'))]
    builder = SpanBuilder(ANCHOR)
    texts = [builder.build_json(rec) for rec in records]
    spans = texts_to_spans(texts)
    assert spans == [s for rec in records for s in builder.build(rec)]
    attributes = {"service.name": "kvtrace", "kvtrace.cfg.num_layers": 8, "kvtrace.cfg.buffer_reuse": True}
    from_text = json_line_to_request(texts_to_json_line(texts, resource_text(attributes), 5))
    from_dicts = json_line_to_request(spans_to_json_line(spans, resource_json(attributes), 5))
    direct = spans_to_request(spans, resource_json(attributes), 5)
    assert from_text == from_dicts == direct
    scope = direct.resource_spans[0].scope_spans[0].scope
    assert scope.name == "otel_kvtrace"
    assert scope.attributes[0].key == "kvtrace.exporter.dropped" and scope.attributes[0].value.int_value == 5
    assert len(direct.resource_spans[0].scope_spans[0].spans) == len(spans) == 24
    status = direct.resource_spans[0].scope_spans[0].spans[12].status
    assert status.message == 'ValueError: quote " and \u00e9'
