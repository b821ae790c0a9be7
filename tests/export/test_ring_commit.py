"""A ring slot is published by its commit word alone, stored after everything else, and a slot that is
committed but does not decode costs one counted task, never the agent.

``struct.pack_into`` zeroes a field group and then fills it in format order, so a commit word packed
together with kind and length becomes visible first; a reader spinning on that slot then saw
``commit == k + 1`` with kind and length still 0 (review 4b, item 1). These tests pin the order down and
feed the decoder every malformed shape such a tear produced.
"""

from __future__ import annotations

import multiprocessing
import os
import struct

import pytest

from otel_kvtrace.export.agent import Agent, Decoder
from otel_kvtrace.export.sinks import JsonLinesFileSink
from otel_kvtrace.export.spans import SpanBuilder, summarize_transfer_tasks
from otel_kvtrace.record import ring as R
from otel_kvtrace.record.model import TaskRecord

from export_records import ANCHOR, fill_record

MODES = {"crc": R.COMMIT_CRC, "order": R.COMMIT_STORE_ORDER}


def _ring(nslots: int, mode: int) -> tuple[R.RingWriter, R.RingReader]:
    fd, mem = R.create_memfd(nslots, mode)
    os.close(fd)
    return R.RingWriter(mem), R.RingReader(mem)


def _slot(k: int) -> int:
    return R.HEADER_BYTES + k * R.SLOT_SIZE


class DroppedCommit:
    """``_COMMIT`` whose store never lands (the commit word is the one store still in flight)."""

    def __init__(self) -> None:
        self.offsets: list[int] = []

    def pack_into(self, mem: object, off: int, value: int) -> None:
        self.offsets.append(off)


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
def test_nothing_but_the_commit_word_publishes_a_slot(mode: int, make_record, monkeypatch) -> None:
    """Every store but the commit word's landed: the reader must not see a message yet (task and side tables)."""
    monkeypatch.setenv("OTEL_KVTRACE_RING_PACK", "python")  # the store held back is the Python path's _COMMIT
    writer, reader = _ring(256, mode)
    dropped = DroppedCommit()
    monkeypatch.setattr(R, "_COMMIT", dropped)
    rec = make_record()
    assert writer.write_task(rec, False, summarize_transfer_tasks(rec.transfer_tasks))
    assert len(dropped.offsets) == writer._head  # one commit store per slot: queue, request ids, summary, task
    assert reader.poll(100) == []
    monkeypatch.undo()
    for k, off in enumerate(dropped.offsets):  # now the commit words land, in order
        R._COMMIT.pack_into(writer._mem, off, k + 1)
    out: list[TaskRecord] = []
    decoder = Decoder()
    for msg in reader.poll(100):
        decoder.feed(msg, out)
    assert [SpanBuilder(ANCHOR).build(r) for r in out] == [SpanBuilder(ANCHOR).build(rec)]


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
@pytest.mark.parametrize("k", [0, 5, 2**32 - 1, 2**32])
def test_a_commit_word_over_a_zeroed_tail_is_not_a_message(mode: int, k: int) -> None:
    """What a reader saw mid-``pack_into`` before: commit == k + 1, crc, kind and length still 0. In crc
    mode ``crc32(b"", k) == k`` made it pass at k = 0 (mod 2**32)."""
    nslots = 256
    writer, reader = _ring(nslots, mode)
    R._COMMIT.pack_into(writer._mem, _slot(k % nslots), k + 1)
    assert reader._read(k) is None
    struct.pack_into("<qIHH", writer._mem, _slot(k % nslots), k + 1, 0, R.MSG_TASK, 0)  # kind landed, not length
    assert reader._read(k) is None


MALFORMED = {
    "empty task": (R.MSG_TASK, b""),
    "short task": (R.MSG_TASK, b"\x01" * (R.TASK_FIXED.size - 1)),
    "unknown kind": (R.MSG_SUMMARY + 7, b"\x00" * 8),
}


def _good_messages(make_record, seq: int) -> list[R.Message]:
    writer, reader = _ring(256, R.COMMIT_CRC)
    rec = make_record(seq=seq)
    writer.write_task(rec, False, summarize_transfer_tasks(rec.transfer_tasks))
    return reader.poll(100)


@pytest.mark.parametrize("name", MALFORMED)
def test_a_malformed_slot_is_counted_lost_and_decoding_goes_on(name: str, make_record) -> None:
    msgs = _good_messages(make_record, seq=7)
    task = next(m for m in msgs if m.kind == R.MSG_TASK)
    kind, body = MALFORMED[name]
    truncated = R.Message(task.index, R.MSG_TASK, task.body[:-8])  # a body cut short: stage ints missing
    decoder = Decoder()
    out: list[TaskRecord] = []
    for msg in [*msgs[:-1], R.Message(99, kind, body), truncated, task]:
        decoder.feed(msg, out)  # never raises
    assert [r.seq for r in out] == [7]
    assert decoder.malformed == 2 and decoder.undecodable == 2  # each may have been a task: lost, counted


def test_a_malformed_side_table_slot_costs_only_the_tasks_that_name_it(make_record) -> None:
    msgs = _good_messages(make_record, seq=7)
    decoder = Decoder()
    out: list[TaskRecord] = []
    for msg in msgs:
        decoder.feed(R.Message(msg.index, msg.kind, b"") if msg.kind == R.MSG_SUMMARY else msg, out)
    assert out == []
    assert decoder.malformed == 1 and decoder.undecodable == 1  # the summary; then the task naming it


def test_the_agent_survives_a_malformed_slot_and_counts_it(make_record, tmp_path) -> None:
    """Through ``Agent._cycle``: the batch after a bad slot is exported; the bad one is in ``lost``, so
    ``exported + lost`` is every task the producer committed."""
    msgs = _good_messages(make_record, seq=7)
    writer, reader = _ring(256, R.COMMIT_CRC)
    sink = JsonLinesFileSink(tmp_path, "run", {})
    agent = Agent(reader, sink, SpanBuilder(ANCHOR), os.getpid(), 0.01, 64)
    bad = R.Message(msgs[-1].index, R.MSG_TASK, b"")
    assert agent._cycle([*msgs[:-1], bad])
    assert agent._cycle([msgs[-1]])
    sink.shutdown()
    assert agent.lost == 1 and reader.hdr[R.H_AGENT_LOST] == 1
    assert reader.hdr[R.H_EXPORTED] == 1
    assert agent.decoder.malformed == 1


# -- two processes ---------------------------------------------------------------------------------

N_TASKS = 30_000


def _produce(mem_fd: int, nslots: int, n: int, done: "multiprocessing.connection.Connection") -> None:
    import mmap

    mem = mmap.mmap(mem_fd, R.ring_bytes(nslots), flags=mmap.MAP_SHARED)
    writer = R.RingWriter(mem)
    rec = fill_record(TaskRecord())
    summary = summarize_transfer_tasks(rec.transfer_tasks)
    dropped = 0
    for seq in range(n):
        rec.seq = seq
        while writer._head - writer.hdr[R.H_READ] > writer._limit - 4:  # wait for room (a serving process
            pass  # would drop): the reader then spins on the very slot being written
        if not writer.write_task(rec, False, summary):
            dropped += 1
    done.send(dropped)


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
def test_a_reader_racing_a_writer_in_another_process_sees_every_task_whole(mode: int) -> None:
    """The writer waits for room, so the reader spins right behind the slot being written, where a torn
    head showed. No timing is asserted: every task is decoded whole, in order (the writer drops none)."""
    nslots = R.CLAIM_MARGIN + 16
    fd, mem = R.create_memfd(nslots, mode)
    reader = R.RingReader(mem)
    decoder = Decoder()
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_produce, args=(fd, nslots, N_TASKS, child))
    proc.start()
    seqs: list[int] = []
    dropped = None
    idle = 0  # a hang guard, not a timing assert: a slot that never completes stalls both sides
    try:
        while (dropped is None or reader.next < reader.hdr[R.H_HEAD]) and idle < 2_000_000:
            out: list[TaskRecord] = []
            msgs = reader.poll(64)
            for msg in msgs:
                decoder.feed(msg, out)
            reader.consumed()
            idle = 0 if msgs else idle + 1
            seqs += [r.seq for r in out]
            if dropped is None and parent.poll():
                dropped = parent.recv()
    finally:
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join()
        os.close(fd)
    assert idle < 2_000_000, f"the reader stalled at slot {reader.next}"
    assert proc.exitcode == 0
    assert decoder.malformed == 0 and decoder.undecodable == 0
    assert dropped == 0 and seqs == list(range(N_TASKS))
