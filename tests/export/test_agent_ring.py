"""The ring between serving process and exporter agent: what goes in comes out as the same spans.

Records are written with ``RingWriter`` (the serving side), read back with ``RingReader`` + the agent's
``Decoder`` and built with the one ``SpanBuilder``; the spans must equal those built from the original
record in-process. Plus the two loss paths: a full ring drops and counts (never blocks), a torn slot
is never decoded and is counted as lost once its producer is gone.
"""

from __future__ import annotations

import struct

import pytest
from export_records import ANCHOR, QUEUE

from otel_kvtrace.export.agent import Decoder
from otel_kvtrace.export.spans import SpanBuilder, summarize_transfer_tasks
from otel_kvtrace.record import ring as R
from otel_kvtrace.record.model import Outcome, QueueInfo, Stage, TaskKind, TaskRecord


def _ring(nslots: int = 256, mode: int | None = None) -> tuple[R.RingWriter, R.RingReader]:
    fd, mem = R.create_memfd(nslots, mode)
    import os

    os.close(fd)
    return R.RingWriter(mem), R.RingReader(mem)


def _decode(reader: R.RingReader, decoder: Decoder | None = None) -> list[TaskRecord]:
    out: list[TaskRecord] = []
    decoder = Decoder() if decoder is None else decoder
    for msg in reader.poll(10_000):
        decoder.feed(msg, out)
    reader.consumed()
    return out


def _raise() -> None:
    raise RuntimeError("copy failed: \"bad\" <addr>")


def _error() -> BaseException:
    try:
        _raise()
    except RuntimeError as exc:
        return exc
    raise AssertionError


VARIANTS = {
    "full": {},
    "no_src_no_gate": {"src_layer": None, "gate_id": None},
    "exact_npu": {"bounded_npu": False},
    "send": {"kind": TaskKind.SEND, "src_layer": None, "gate_id": None, "consumer_wait": False},
    "error": {"outcome": Outcome.ERROR, "error": _error()},
    "many_calls": {"save_cpu_calls": 9},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_task_through_the_ring_builds_the_same_spans(make_record, variant: str) -> None:
    writer, reader = _ring()
    original = make_record(**VARIANTS[variant])
    assert writer.write_task(original, False, summarize_transfer_tasks(original.transfer_tasks))
    (decoded,) = _decode(reader)
    builder = SpanBuilder(ANCHOR)
    assert builder.build(decoded) == builder.build(original)


def test_awaited_task_joins_its_consumer_wait_sent_later(make_record) -> None:
    writer, reader = _ring()
    complete = make_record()  # with its consumer_wait stage
    partial = make_record(consumer_wait=False)
    assert writer.write_task(partial, True, summarize_transfer_tasks(partial.transfer_tasks))
    # The forward records its wait after the recv thread shipped the task.
    partial.stages.extend(complete.stages[-3:])
    assert writer.write_cwait(partial, R.REASON_WAITED, R.consumer_stages(partial.stages))
    (decoded,) = _decode(reader)
    builder = SpanBuilder(ANCHOR)
    assert builder.build(decoded) == builder.build(complete)


def _root_attrs(builder: SpanBuilder, rec: TaskRecord) -> dict[str, object]:
    root = builder.build(rec)[0]
    return {a["key"]: next(iter(a["value"].values())) for a in root["attributes"]}


def test_released_without_consumer_wait_says_why(make_record) -> None:
    writer, reader = _ring()
    rec = make_record(consumer_wait=False)
    writer.write_task(rec, True, summarize_transfer_tasks(rec.transfer_tasks))
    writer.write_cwait(rec, R.REASON_STEP_BOUNDARY, [])
    other = make_record(consumer_wait=False, seq=4, layer_id=6)
    writer.write_task(other, True, summarize_transfer_tasks(other.transfer_tasks))
    out: list[TaskRecord] = []
    decoder = Decoder()
    for msg in reader.poll(100):
        decoder.feed(msg, out)
    assert len(out) == 1  # the second still awaits its consumer
    decoder.release_awaiting(R.REASON_PRODUCER_DIED, out)
    builder = SpanBuilder(ANCHOR)
    reasons = [_root_attrs(builder, r)["kvtrace.consumer_wait_missing"] for r in out]
    assert reasons == ["step_boundary", "producer_died"]
    assert all(s["name"] != "consumer_wait" for r in out for s in builder.build(r))


def test_queue_and_request_ids_are_sent_once_and_survive_escaping(make_record) -> None:
    writer, reader = _ring()
    queue = QueueInfo(run_id='run "q"\u00e9', path="key", thread_name="t\n1", pid=7, dp=1, tp=3, num_layers=4)
    for seq in range(3):
        rec = make_record(queue=queue, seq=seq)
        writer.write_task(rec, False, summarize_transfer_tasks(rec.transfer_tasks))
    kinds = [m.kind for m in reader.poll(100)]
    assert kinds.count(R.MSG_QUEUE) == 1 and kinds.count(R.MSG_REQ) == 3 and kinds.count(R.MSG_TASK) == 3
    reader.next = 0
    decoded = _decode(reader)
    assert [r.queue for r in decoded] == [queue] * 3
    assert decoded[0].transfer_tasks.request_ids == ["reqA", "reqB", "reqC"]


def test_full_ring_drops_and_counts_without_blocking(make_record) -> None:
    writer, reader = _ring(nslots=R.CLAIM_MARGIN + 16)
    rec = make_record()
    summary = summarize_transfer_tasks(rec.transfer_tasks)
    results = [writer.write_task(rec, False, summary) for _ in range(100)]
    written = sum(results)
    assert 0 < written <= 16  # counted by the recorder: test_the_dropped_count_the_agent_reads_...
    got = _decode(reader)
    assert len(got) == written
    assert writer.write_task(rec, False, summary)  # room again once the agent consumed


def test_a_torn_slot_is_never_decoded_and_counts_as_lost(make_record) -> None:
    """crc mode (aarch64): a body byte that changed after the commit (a write seen out of order)."""
    writer, reader = _ring(mode=R.COMMIT_CRC)
    rec = make_record()
    summary = summarize_transfer_tasks(rec.transfer_tasks)
    writer.write_task(rec, False, summary)  # queue def, 3 request ids, summary, task: slots 0..5
    writer.write_task(rec, False, summary)  # slot 6
    torn = R.HEADER_BYTES + 5 * R.SLOT_SIZE + R.SLOT_HEAD.size + 20
    writer._mem[torn] ^= 0xFF  # a write cut short / seen out of order
    msgs = reader.poll(100)
    assert [m.kind for m in msgs] == [R.MSG_QUEUE, R.MSG_REQ, R.MSG_REQ, R.MSG_REQ, R.MSG_SUMMARY]
    after, lost = reader.skip_to_head()  # the producer died
    assert lost == 1 and [m.kind for m in after] == [R.MSG_TASK]


@pytest.mark.parametrize("mode", [R.COMMIT_CRC, R.COMMIT_STORE_ORDER])
def test_a_partial_slot_of_a_writer_killed_mid_write_is_rejected_and_counted(make_record, mode: int) -> None:
    """The claim and part of the body landed, the commit word never did (the serving process died)."""
    writer, reader = _ring(mode=mode)
    rec = make_record()
    writer.write_task(rec, False, summarize_transfer_tasks(rec.transfer_tasks))  # slots 0..5
    k = writer._claim()  # slot 6: claimed ...
    body = R.HEADER_BYTES + (k % writer.nslots) * R.SLOT_SIZE + R.SLOT_HEAD.size
    R.TASK_LAYOUTS[0].pack_into(writer._mem, body, *R.TASK_LAYOUTS[0].unpack_from(reader.poll(6)[-1].body))
    reader.next = 0
    msgs = reader.poll(100)  # ... half written, never committed: the reader stops there
    assert len(msgs) == 6 and reader.next == k
    after, lost = reader.skip_to_head()
    assert after == [] and lost == 1


def test_store_order_mode_publishes_with_the_commit_word_alone(make_record) -> None:
    """x86-64: no crc is written or checked; the commit word (stored last, alone) is what counts."""
    writer, reader = _ring(mode=R.COMMIT_STORE_ORDER)
    rec = make_record()
    assert writer.write_task(rec, False, summarize_transfer_tasks(rec.transfer_tasks))
    assert R.SLOT_HEAD.unpack_from(writer._mem, R.HEADER_BYTES + 5 * R.SLOT_SIZE)[1] == 0  # no crc
    (decoded,) = _decode(reader)
    assert SpanBuilder(ANCHOR).build(decoded) == SpanBuilder(ANCHOR).build(rec)
    k = 6 + writer.nslots  # a later lap's slot whose commit word did not land yet is never read
    assert reader._read(k) is None


@pytest.mark.parametrize(("machine", "env", "mode"), [
    ("x86_64", "", R.COMMIT_STORE_ORDER), ("AMD64", "auto", R.COMMIT_STORE_ORDER), ("aarch64", "", R.COMMIT_CRC),
    ("x86_64", "crc", R.COMMIT_CRC), ("aarch64", "order", R.COMMIT_STORE_ORDER), ("aarch64", "bogus", R.COMMIT_CRC),
])
def test_the_commit_mode_follows_the_cpu_unless_overridden(machine: str, env: str, mode: int, monkeypatch) -> None:
    """Store order only on x86-64 (TSO); ``OTEL_KVTRACE_RING_COMMIT`` overrides it (e.g. x86 emulation on
    a weakly ordered host); the ring header carries the producer's choice to the agent."""
    import platform

    monkeypatch.setattr(platform, "machine", lambda: machine)
    monkeypatch.setenv("OTEL_KVTRACE_RING_COMMIT", env)
    assert R.default_commit_mode() == mode
    writer, reader = _ring()
    assert writer._crc == reader._crc == (mode == R.COMMIT_CRC)


def test_more_stages_than_a_slot_holds_are_folded_like_the_builder(make_record) -> None:
    writer, reader = _ring()
    rec = make_record()
    for i in range(40):
        rec.stages.extend((Stage.H2D_STAGGER, rec.t_dequeue + i, rec.t_dequeue + i + 1))
    writer.write_task(rec, False, summarize_transfer_tasks(rec.transfer_tasks))
    (decoded,) = _decode(reader)
    builder = SpanBuilder(ANCHOR)
    names = lambda spans: {(s["name"], s["startTimeUnixNano"], s["endTimeUnixNano"]) for s in spans}  # noqa: E731
    assert names(builder.build(decoded)) == names(builder.build(rec))
    assert struct.calcsize("<q") * R.MAX_STAGE_INTS < R.BODY_BYTES


def test_the_documented_layout_is_the_code_layout() -> None:
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "export.md").read_text()
    assert f"`{R.TASK_FIXED.format}`" in doc
    assert f"{R.DEFAULT_SLOTS} slots of {R.SLOT_SIZE} bytes" in doc
    assert f"then up to {R.MAX_STAGE_INTS // 3} stage triples (int64)" in doc
    assert f"`{R.SUMMARY_FIXED.format}`" in doc
    assert f"up to {R.MAX_GROUPS} group ids (int64) and {R.MAX_REQS} request-id indices" in doc
    assert f"{R.HEADER_BYTES} bytes" in doc and f"{R.CLAIM_MARGIN} slots are kept spare" in doc


def test_a_write_that_fails_after_its_claim_still_frees_the_slot(make_record) -> None:
    writer, reader = _ring()
    bad = make_record()
    bad.seq = 1 << 70  # does not fit int64: pack_into raises after the slot was claimed
    with pytest.raises(struct.error):
        writer.write_task(bad, False, summarize_transfer_tasks(bad.transfer_tasks))
    good = make_record(seq=5)
    writer.write_task(good, False, summarize_transfer_tasks(good.transfer_tasks))
    (decoded,) = _decode(reader)  # the reader went past the failed slot
    assert decoded.seq == 5


def test_a_queue_definition_lost_to_a_full_ring_is_sent_again(make_record) -> None:
    writer, reader = _ring(nslots=R.CLAIM_MARGIN + 4)
    rec = make_record()
    summary = summarize_transfer_tasks(rec.transfer_tasks)
    for _ in range(4):
        writer.write_task(rec, False, summary)  # fills the ring (queue def + 3 request ids)
    other = make_record(queue=QueueInfo(run_id="r2", path="key", thread_name="t", pid=9), seq=8)
    assert not writer.write_task(other, False, summary)  # ring full: its queue definition was dropped too
    decoder = Decoder()
    _decode(reader, decoder)
    assert writer.write_task(other, False, summary)  # room again: definition and task both written
    (decoded,) = _decode(reader, decoder)
    assert decoded.queue.run_id == "r2" and decoded.seq == 8


def test_shipping_through_the_ring_leaves_no_garbage_for_the_cyclic_gc(make_record) -> None:
    """With the ring, a recorded task (and the upstream objects it references) is freed as soon as it is
    written, so recording never builds up the young generation that makes the GC pause the recording
    thread; the in-process hand-off keeps records until export, and the GC runs."""
    import gc

    from export_records import fill_record

    from otel_kvtrace.record.recorder import Recorder

    def young_collections(ring: bool) -> int:
        recorder = Recorder(capacity=20_000)
        if ring:
            writer, _reader = _ring(nslots=8192)  # room for every task: nobody drains during the count
            recorder.attach_ring(writer)
        gc.collect()
        before = gc.get_stats()[0]["collections"]
        for i in range(5000):
            rec = recorder.new_record()
            fill_record(rec, seq=i)
            recorder.submit(rec)
        assert recorder.dropped == 0
        return gc.get_stats()[0]["collections"] - before

    assert young_collections(ring=True) == 0
    assert young_collections(ring=False) > 0


def test_a_previous_laps_body_seen_with_this_laps_commit_is_never_decoded(make_record) -> None:
    """aarch64 may show the new commit word before the new body and crc: the old lap must not pass."""
    writer, reader = _ring(nslots=R.CLAIM_MARGIN + 8, mode=R.COMMIT_CRC)
    rec = make_record()
    writer.write_task(rec, False, summarize_transfer_tasks(rec.transfer_tasks))  # slots 0..4
    k = 4 + writer.nslots  # the same slot, one lap later
    R._COMMIT.pack_into(writer._mem, R.HEADER_BYTES + 4 * R.SLOT_SIZE, k + 1)  # only the commit store landed
    assert reader._read(k) is None
    # The whole new tail and commit word visible before the new body: still unread.
    off = R.HEADER_BYTES + 4 * R.SLOT_SIZE
    new_body = bytes(range(7, 107))
    kind = R.MSG_RESOURCE | R.KIND_WRITTEN
    R.SLOT_HEAD.pack_into(writer._mem, off, k + 1, R.slot_crc(new_body, k, kind, len(new_body)), kind, len(new_body))
    assert reader._read(k) is None
    writer._mem[off + R.SLOT_HEAD.size : off + R.SLOT_HEAD.size + len(new_body)] = new_body  # the body lands
    assert reader._read(k).body == new_body


def test_a_failure_before_the_pack_does_not_leave_a_claimed_slot(make_record) -> None:
    class BadStages(list):
        def __iter__(self):  # type: ignore[override]
            raise RuntimeError("stages changed under us")

    writer, reader = _ring()
    bad = make_record()
    bad.stages = BadStages(bad.stages)
    with pytest.raises(RuntimeError):
        writer.write_task(bad, False, summarize_transfer_tasks(bad.transfer_tasks))
    good = make_record(seq=5)
    writer.write_task(good, False, summarize_transfer_tasks(good.transfer_tasks))
    (decoded,) = _decode(reader)  # nothing stalls the reader
    assert decoded.seq == 5


def test_the_dropped_count_the_agent_reads_is_the_recorders_task_count(make_record) -> None:
    from otel_kvtrace.record.recorder import Recorder

    writer, reader = _ring(nslots=R.CLAIM_MARGIN + 4)
    recorder = Recorder(capacity=100)
    recorder.attach_ring(writer)
    for seq in range(10):  # a new queue each time: its definition is dropped along with the task
        rec = make_record(queue=QueueInfo(run_id=f"r{seq}", path="key", thread_name="t", pid=9), seq=seq)
        recorder.submit(rec)
    assert recorder.dropped > 0 and writer.hdr[R.H_DROPPED] == recorder.dropped


def test_a_task_whose_request_id_definition_was_dropped_is_never_exported_with_a_made_up_id(make_record) -> None:
    """The agent frees room between a dropped request-id definition and the task's claim."""
    writer, reader = _ring(nslots=R.CLAIM_MARGIN + 3)
    decoder = Decoder()

    class DrainAfterTheIds(list):
        def __iter__(self):  # type: ignore[override]
            yield from list.__iter__(self)
            _decode(reader, decoder)  # after the ids were sent, before the task's claim

    rec = make_record()  # queue definition + reqA + reqB fill the ring: reqC's definition is dropped
    summary = summarize_transfer_tasks(rec.transfer_tasks)
    summary.request_ids = DrainAfterTheIds(summary.request_ids)
    writer.write_task(rec, False, summary)
    decoded = _decode(reader, decoder)
    assert all(not r.startswith("#") for d in decoded for r in d.transfer_tasks.request_ids)
    assert decoder.undecodable == 0  # not written at all: the recorder counts it as dropped


def test_the_agent_drops_and_counts_a_task_naming_an_unknown_request_index(make_record) -> None:
    from otel_kvtrace.export.agent import Decoder

    writer, reader = _ring()
    rec = make_record()
    writer.write_task(rec, False, summarize_transfer_tasks(rec.transfer_tasks))
    decoder = Decoder()
    out: list[TaskRecord] = []
    for msg in reader.poll(100):
        if msg.kind != R.MSG_REQ or msg.body[:4] != b"\x01\x00\x00\x00":  # request id #1 never arrives
            decoder.feed(msg, out)
    assert out == [] and decoder.undecodable == 1


def test_shipping_names_at_most_one_request_id_past_what_the_ring_carries(make_record) -> None:
    """The recording thread does not ``str()`` every request of a big task; the block count stays exact."""
    from types import SimpleNamespace

    from otel_kvtrace.record.recorder import Recorder

    named = []

    class ReqId:
        def __init__(self, i: int) -> None:
            self.i = i

        def __str__(self) -> str:
            named.append(self.i)
            return f"req-{self.i}"

    ranges = [SimpleNamespace(request=SimpleNamespace(req_id=ReqId(i)), start_block=0, end_block=2)
              for i in range(1000)]
    writer, reader = _ring()
    recorder = Recorder(capacity=10)
    recorder.attach_ring(writer)
    rec = make_record()
    rec.transfer_tasks = [SimpleNamespace(group_id=0, shared_block_data=None, block_ranges=ranges)]
    recorder.submit(rec)
    (decoded,) = _decode(reader)
    assert len(named) <= R.MAX_REQS + 1
    assert decoded.transfer_tasks.num_blocks == 2000
    assert decoded.transfer_tasks.request_ids == [f"req-{i}" for i in range(R.MAX_REQS)]


def test_a_summary_shared_by_a_step_is_named_right_also_after_the_id_table_reset(make_record) -> None:
    """The writer keeps the ring view (request indices) of the step's summary; when its id table is
    reset (bounded at 65536), the cached indices are stale and the ids must be defined again."""
    from otel_kvtrace.export.spans import TransferSummary

    writer, reader = _ring()
    decoder = Decoder()
    step = TransferSummary([0], ["r-step"], 4)
    for layer in range(3):
        assert writer.write_task(make_record(seq=layer, layer_id=layer), False, step)
    other = TransferSummary([1], ["r-other"], 2)  # the next summary (a new step) is not confused with it
    assert writer.write_task(make_record(seq=3), False, other)
    got = _decode(reader, decoder)
    assert [r.transfer_tasks.request_ids for r in got] == [["r-step"]] * 3 + [["r-other"]]
    writer._req_ids.update((f"filler-{i}", 10**6 + i) for i in range(65536 - len(writer._req_ids)))
    writer.req_index("r-new")  # the table is full: reset, "r-new" gets the first index of the new table
    decoder.req_ids.clear()  # as the agent may evict them later: only ids defined again can be named
    decoder.req_ids.update((i, n) for n, i in writer._req_ids.items())
    assert writer.write_task(make_record(seq=4), False, other)
    (last,) = _decode(reader, decoder)
    assert last.transfer_tasks.request_ids == ["r-other"]
