"""The ring writer names a step's transfer-task summary once (one ``MSG_SUMMARY``) and reuses its index
across the layers of the step (the same ``SharedBlockData`` object), and never ships a stale one when
the shared data changes; the agent decodes the same summary ``summarize_transfer_tasks`` computes."""

from __future__ import annotations

import os

from export_records import FakeBlockRange, FakeLayerTransferTask, FakeReq, FakeShared, fill_record

from otel_kvtrace.export.agent import Decoder
from otel_kvtrace.export.spans import summarize_transfer_tasks
from otel_kvtrace.record import ring as R
from otel_kvtrace.record.model import TaskKind, TaskRecord


class CountingId:
    """A request id that counts how often it is named (``str``): each count is one real summary."""

    calls = 0

    def __init__(self, name: str) -> None:
        self.name = name

    def __str__(self) -> str:
        CountingId.calls += 1
        return self.name


def _shared(*names: str, blocks: int = 4) -> FakeShared:
    return FakeShared(req_ids=[CountingId(n) for n in names], block_ids_arr=list(range(blocks)),
                      is_last_chunks=[True] * len(names), load_keys=[])


def _task(shared: FakeShared | None, layer: int, group: int = 0) -> FakeLayerTransferTask:
    return FakeLayerTransferTask(group_id=group, layer_idx_in_group=layer, shared_block_data=shared)


class Shipper:
    """Writes records whose ``transfer_tasks`` are given through one ring; decodes what the agent sees."""

    def __init__(self) -> None:
        fd, mem = R.create_memfd(1024)
        os.close(fd)
        self.writer, self.reader = R.RingWriter(mem), R.RingReader(mem)
        self.decoder = Decoder()
        self.seq = 0

    def ship(self, tasks: object, kind: int = TaskKind.RECV) -> tuple[list[int], list[str], int]:
        rec = fill_record(TaskRecord(), seq=self.seq, kind=kind)
        self.seq += 1
        rec.transfer_tasks = tasks
        assert self.writer.write_task(rec, False)
        (got,) = self.decode()
        s = got.transfer_tasks
        return s.group_ids, s.request_ids, s.num_blocks

    def decode(self) -> list[TaskRecord]:
        out: list[TaskRecord] = []
        for msg in self.reader.poll(10_000):
            self.summaries += msg.kind == R.MSG_SUMMARY
            self.decoder.feed(msg, out)
        self.reader.consumed()
        return out

    summaries = 0


def test_the_layers_of_one_step_share_one_summary() -> None:
    ship = Shipper()
    shared = _shared("a", "b")
    first = ship.ship(_task(shared, 0))
    calls = CountingId.calls
    for layer in range(1, 8):  # every layer's task of the step carries the same shared data
        assert ship.ship(_task(shared, layer)) == first
        assert ship.ship([_task(shared, layer)]) == first  # the list form the wrappers may store too
    assert CountingId.calls == calls, "the cached summary was recomputed"
    assert ship.summaries == 1, "the summary was sent again"
    assert first == ([0], ["a", "b"], 4)


def test_a_changed_shared_data_is_summarised_afresh() -> None:
    ship = Shipper()
    shared = _shared("a")
    assert ship.ship(_task(shared, 0)) == ([0], ["a"], 4)
    # the next step: new shared data (upstream builds one per step)
    assert ship.ship(_task(_shared("b", "c", blocks=2), 0)) == ([0], ["b", "c"], 2)
    # the same object, its id list replaced
    shared = _shared("a")
    ship.ship(_task(shared, 0))
    shared.req_ids = [CountingId("z")]
    assert ship.ship(_task(shared, 1)) == ([0], ["z"], 4)
    # the same list, grown in place
    shared.req_ids.append(CountingId("y"))
    assert ship.ship(_task(shared, 2)) == ([0], ["z", "y"], 4)
    # a new block array
    shared.block_ids_arr = [1]
    assert ship.ship(_task(shared, 3)) == ([0], ["z", "y"], 1)
    # the same block list, grown in place
    shared.block_ids_arr.append(2)
    assert ship.ship(_task(shared, 3)) == ([0], ["z", "y"], 2)
    # another group, same shared data
    assert ship.ship(_task(shared, 3, group=2)) == ([2], ["z", "y"], 2)


def test_equal_summaries_of_new_shared_data_reuse_the_definition() -> None:
    ship = Shipper()
    for _ in range(3):  # a new SharedBlockData object with the same content: summarised, not re-sent
        assert ship.ship(_task(_shared("a"), 0)) == ([0], ["a"], 4)
    assert ship.summaries == 1


def test_whatever_is_not_one_task_with_shared_data_is_summarised_exactly() -> None:
    ship = Shipper()
    shared = _shared("a")
    two = [_task(shared, 0), _task(_shared("b"), 0, group=1)]
    expected = summarize_transfer_tasks(two)
    assert ship.ship(two) == (expected.group_ids, expected.request_ids, expected.num_blocks) == ([0, 1], ["a", "b"], 8)
    ranged = FakeLayerTransferTask(group_id=3, layer_idx_in_group=0,
                                   block_ranges=[FakeBlockRange(FakeReq("k"), 2, 5)])
    assert ship.ship(ranged) == ([3], ["k"], 3)  # key path: no shared data
    ranged.block_ranges[0].end_block = 9
    assert ship.ship(ranged) == ([3], ["k"], 7)
    assert ship.ship(None) == ([], [], 0)


def test_recv_and_send_tasks_keep_their_own_entry() -> None:
    ship = Shipper()
    load, save = _shared("load"), _shared("save")
    loaded = ship.ship(_task(load, 0), TaskKind.RECV)
    saved = ship.ship(_task(save, 0), TaskKind.SEND)
    sent = ship.summaries
    assert ship.ship(_task(load, 1), TaskKind.RECV) == loaded and ship.ship(_task(save, 1), TaskKind.SEND) == saved
    assert ship.summaries == sent
    assert loaded[1] == ["load"] and saved[1] == ["save"]


def test_a_cached_summary_index_is_defined_again_after_a_generation(monkeypatch) -> None:
    """The recv tasks reuse one cached summary (same shared data) while every send task defines a new one;
    the agent keeps only the newest 2 generations. The writer must define the cached one again before
    the agent forgets it: no task is lost, none decoded against another summary."""
    monkeypatch.setattr(R, "SUMMARY_GENERATION", 4)
    ship = Shipper()
    load = _shared("load")
    resent = 0
    for i in range(40):  # 10 generations of definitions, past the agent's bound more than once
        before = ship.summaries
        assert ship.ship(_task(load, i % 8), TaskKind.RECV) == ([0], ["load"], 4)
        resent += ship.summaries - before
        assert ship.ship(_task(_shared(f"save{i}"), 0), TaskKind.SEND) == ([0], [f"save{i}"], 4)
    assert ship.decoder.undecodable == 0
    assert len(ship.decoder.summaries) <= 2 * 4 + 2  # bounded: old definitions were evicted meanwhile
    assert resent > 1  # the cached recv summary was defined again after a generation bump


def test_a_task_naming_a_summary_the_agent_never_saw_is_counted_not_misattributed() -> None:
    """A definition lost (ring overflow) leaves its index unknown: the task is counted, not given the
    summary an earlier task had."""
    ship = Shipper()
    assert ship.ship(_task(_shared("a"), 0)) == ([0], ["a"], 4)
    rec = fill_record(TaskRecord(), seq=99)
    rec.transfer_tasks = _task(_shared("b"), 0)
    assert ship.writer.write_task(rec, False)
    out: list[TaskRecord] = []
    for msg in ship.reader.poll(100):
        if msg.kind != R.MSG_SUMMARY:  # this definition never reaches the agent
            ship.decoder.feed(msg, out)
    assert out == [] and ship.decoder.undecodable == 1


def test_a_summary_that_did_not_fit_is_not_cached() -> None:
    """Ring full between the request id and the summary: nothing names the unwritten index afterwards."""
    fd, mem = R.create_memfd(R.CLAIM_MARGIN + 5)
    os.close(fd)
    writer, reader, decoder = R.RingWriter(mem), R.RingReader(mem), Decoder()
    shared = _shared("a")
    first = fill_record(TaskRecord(), seq=1)
    first.transfer_tasks = _task(shared, 0)
    assert writer.write_task(first, False)  # queue, request id, summary, task: 4 of 5 slots
    second = fill_record(TaskRecord(), seq=2)
    second.transfer_tasks = _task(_shared("b"), 0)
    assert not writer.write_task(second, False)  # request id "b" fits, its summary does not: dropped
    out: list[TaskRecord] = []
    for msg in reader.poll(100):
        decoder.feed(msg, out)
    reader.consumed()
    assert writer.write_task(second, False)  # room again: the summary is defined now, not assumed
    for msg in reader.poll(100):
        decoder.feed(msg, out)
    assert [(r.seq, r.transfer_tasks.request_ids) for r in out] == [(1, ["a"]), (2, ["b"])]
    assert decoder.undecodable == 0
