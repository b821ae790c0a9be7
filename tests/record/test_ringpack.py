"""The C task packer (``otel_kvtrace/record/_ringpack.c``) against the pure-Python reference in ``ring.py``.

Two rings are driven with the same generated records, one by each packer; after every write the two
mappings (header words and every slot byte) must be equal, and what the real ``RingReader`` and the agent's
``Decoder`` read back must be equal too. Inputs the C code does not take (a non-int, an int out of a field's
range) go to the Python path, so even the failing writes leave identical rings.
"""

from __future__ import annotations

import dataclasses
import os
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from otel_kvtrace.export.agent import Decoder
from otel_kvtrace.export.spans import TransferSummary
from otel_kvtrace.record import ring as R
from otel_kvtrace.record.model import NO_TIME, NUM_DEPS, QueueInfo, TaskRecord
from tests.native import require_built

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "export"))
from export_records import FakeLayerTransferTask, FakeShared  # noqa: E402

NATIVE = R._NATIVE
needs_native = pytest.mark.skipif(NATIVE is None, reason=f"native packer {R._NATIVE_MISSING}")
QUEUE = QueueInfo(run_id="pack", path="gva", thread_name="KVCacheRecvThread", pid=7, tp=1, num_layers=8)
I64 = (-(1 << 63), (1 << 63) - 1)


def _ring(nslots: int, commit: int) -> Any:
    fd, mem = R.create_memfd(nslots, commit)
    os.close(fd)
    return mem


def _pair(nslots: int, commit: int, monkeypatch: pytest.MonkeyPatch, cls: Any = R.RingWriter) -> tuple[Any, Any]:
    """(native writer, Python writer) over two fresh rings of the same shape."""
    monkeypatch.delenv("OTEL_KVTRACE_RING_PACK", raising=False)  # a CI environment's =python must not fail this
    native = cls(_ring(nslots, commit))
    monkeypatch.setenv("OTEL_KVTRACE_RING_PACK", "python")
    python = cls(_ring(nslots, commit))
    monkeypatch.delenv("OTEL_KVTRACE_RING_PACK")
    assert native._packer is not None and python._packer is None
    return native, python


# -- generated records -------------------------------------------------------------------------------------
stamp = st.one_of(st.just(NO_TIME), st.integers(0, 1 << 62), st.integers(*I64))


@st.composite
def records(draw: Any) -> tuple[TaskRecord, bool, Any]:
    rec = TaskRecord()
    rec.queue = QUEUE
    rec.kind = draw(st.integers(0, 1))
    rec.seq = draw(st.integers(*I64))
    rec.step = draw(st.integers(0, 1 << 40))
    rec.layer_id = draw(st.integers(-(1 << 31), (1 << 31) - 1))
    rec.final_layer = draw(st.booleans())
    rec.wait_for_save_layer = draw(st.one_of(st.none(), st.integers(-(1 << 31), (1 << 31) - 1)))
    rec.gate_id = draw(st.one_of(st.none(), st.integers(*I64)))
    rec.queue_depth_at_enqueue = draw(st.integers(0, 1 << 31 - 1))
    rec.inflight_at_enqueue = draw(st.integers(0, 100))
    rec.t_enqueue, rec.t_dequeue, rec.t_backend_return, rec.t_complete = (draw(stamp) for _ in range(4))
    n_triples = draw(st.one_of(st.integers(0, 22), st.integers(23, 40)))  # above 22: folded
    for _ in range(n_triples):
        rec.stages.extend((draw(st.integers(0, 8)), draw(stamp), draw(stamp)))
    rec.deps[:] = [draw(stamp) for _ in range(2 * NUM_DEPS)]
    rec.has_dep = draw(st.integers(0, 31))
    rec.outcome = draw(st.integers(0, 2))
    rec.nbytes = draw(st.integers(0, 1 << 40))
    rec.backend_result = draw(st.integers(*I64))
    if draw(st.integers(0, 9)) == 0:
        rec.error = ValueError("boom")
    # A few inputs the C path leaves to Python: that path raises (struct.error), both rings get MSG_VOID.
    bad = draw(st.integers(0, 19))
    if bad == 0:
        rec.t_complete = 1 << 63  # int64 overflow
    elif bad == 1:
        rec.kind = 256  # out of its byte
    elif bad == 2:
        rec.stages.append(1.5)  # not an int (and not a whole triple)
    elif bad == 3:
        rec.layer_id = 1 << 31
    summary = None
    if draw(st.booleans()):
        summary = TransferSummary(group_ids=[draw(st.integers(0, 3))], request_ids=["a", "b"],
                                  num_blocks=draw(st.integers(0, 64)))
    return rec, draw(st.booleans()), summary


def _copy(rec: TaskRecord) -> TaskRecord:
    return dataclasses.replace(rec, stages=list(rec.stages), deps=list(rec.deps), npu_marks=[], holds=[])


def _write(writer: Any, rec: TaskRecord, awaiting: bool, summary: Any) -> Any:
    try:
        return writer.write_task(rec, awaiting, summary)
    except Exception as exc:  # noqa: BLE001 - the recorder turns it into "tracing disabled"
        return type(exc)


def _decoded(reader: Any, decoder: Decoder) -> list[Any]:
    out: list[Any] = []
    for msg in reader.poll(10_000):
        decoder.feed(msg, out)
    reader.consumed()
    return [(r.seq, r.kind, r.step, r.layer_id, r.final_layer, r.wait_for_save_layer, r.gate_id, r.t_enqueue,
             r.t_dequeue, r.t_backend_return, r.t_complete, list(r.stages), list(r.deps), r.has_dep, r.outcome,
             r.nbytes, r.backend_result, type(r.error).__name__) for r in out]


@needs_native
@pytest.mark.parametrize("commit", [R.COMMIT_STORE_ORDER, R.COMMIT_CRC])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.lists(st.tuples(records(), st.booleans()), min_size=1, max_size=40))
def test_both_packers_write_the_same_bytes(commit: int, batch: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    nslots = 128  # laps within one example: stale bytes of earlier laps must be left alike too
    native, python = _pair(nslots, commit, monkeypatch)
    readers = [R.RingReader(native._mem), R.RingReader(python._mem)]
    decoders = [Decoder(), Decoder()]
    for (rec, awaiting, summary), consume in batch:
        results = [_write(w, _copy(rec), awaiting, summary) for w in (native, python)]
        assert results[0] == results[1]
        assert native._mem[:] == python._mem[:]  # header words and every slot
        assert native._head == python._head
        if consume:  # else the rings fill up: both drop alike (False)
            assert _decoded(readers[0], decoders[0]) == _decoded(readers[1], decoders[1])
            assert native._mem[:] == python._mem[:]
    assert decoders[0].malformed == decoders[1].malformed == 0


@needs_native
@pytest.mark.parametrize("commit", [R.COMMIT_STORE_ORDER, R.COMMIT_CRC])
def test_every_stage_count_round_trips(commit: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """0..MAX_STAGE_INTS + 9 stage ints (folding above the cap), both packers, decoded by the agent."""
    native, python = _pair(256, commit, monkeypatch)
    readers = [R.RingReader(w._mem) for w in (native, python)]
    decoders = [Decoder(), Decoder()]
    for n in range(0, R.MAX_STAGE_INTS + 10, 3):
        rec = TaskRecord(queue=QUEUE, seq=n, t_enqueue=5_000_000_000 + n, gate_id=n)
        rec.stages.extend(x for i in range(n // 3) for x in (i % 9, 10 * i, 10 * i + 5))
        for w in (native, python):
            assert w.write_task(_copy(rec), False)  # (an awaiting task waits in the decoder for its cwait)
        assert native._mem[:] == python._mem[:]
        got = [_decoded(r, d) for r, d in zip(readers, decoders)]
        assert got[0] == got[1] and len(got[0]) == 1
        expected = rec.stages if n <= R.MAX_STAGE_INTS else R.fold_stages(rec.stages)
        assert got[0][0][11] == expected


@needs_native
@pytest.mark.parametrize("commit", [R.COMMIT_STORE_ORDER, R.COMMIT_CRC])
def test_an_awaiting_fold_packs_a_snapshot_of_the_stages(commit: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The forward may append its consumer-wait triple while an awaiting task is folded (``fold_stages`` is
    Python code: the GIL can switch). The Python path folds ``tuple(rec.stages)``, so the triple is only in
    the later ``MSG_CWAIT``; the C path must fold a snapshot too, or the body would carry it as well."""
    live: list[TaskRecord] = []

    def appending_fold(stages: Any) -> list[int]:  # the forward's append, made to happen mid-fold
        live[0].stages.extend((int(R.Stage.CONSUMER_WAIT), 7, 9))
        return real_fold(stages)

    real_fold = R.fold_stages
    monkeypatch.setattr(R, "fold_stages", appending_fold)  # before the writers: the packer holds it
    native, python = _pair(128, commit, monkeypatch)
    for awaiting in (True, False):
        rec = TaskRecord(queue=QUEUE, seq=3, t_enqueue=5_000_000_000)
        rec.stages.extend(x for i in range(30) for x in (i % 4, 10 * i, 10 * i + 5))  # > 22 triples: folded
        for w in (native, python):
            copy = _copy(rec)
            live[:] = [copy]
            assert w.write_task(copy, awaiting)
            assert copy.stages[-3:] == [int(R.Stage.CONSUMER_WAIT), 7, 9]  # the append did happen
        assert native._mem[:] == python._mem[:]
    got = [_decoded(R.RingReader(w._mem), Decoder()) for w in (native, python)]
    assert got[0] == got[1]


class _FailingHead(R.RingWriter):
    """A writer whose claim hint cannot be stored once ``fail`` is set: the slot is claimed, not written."""

    fail = False

    @property
    def _head(self) -> int:
        return self._hint

    @_head.setter
    def _head(self, value: int) -> None:
        if self.fail:
            self.fail = False
            raise RuntimeError("claim hint not stored")
        self._hint = value


@pytest.mark.parametrize("commit", [R.COMMIT_STORE_ORDER, R.COMMIT_CRC])
def test_a_claimed_slot_whose_write_fails_is_committed_void_by_both_packers(
        commit: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Claimed but not committed would stall the agent: both packers commit ``MSG_VOID`` there, raise, and
    the next task goes to the next slot (the Python writer alone when the extension is not built)."""
    if NATIVE is None:
        monkeypatch.setenv("OTEL_KVTRACE_RING_PACK", "python")
        writers = [_FailingHead(_ring(128, commit))]
    else:
        writers = list(_pair(128, commit, monkeypatch, _FailingHead))
        assert writers[0]._packer is not None
    for w in writers:
        assert w.write_task(TaskRecord(queue=QUEUE, seq=1, t_enqueue=5), False)  # slot 0: queue, 1: task
        w.fail = True
        with pytest.raises(RuntimeError, match="claim hint"):
            w.write_task(TaskRecord(queue=QUEUE, seq=2, t_enqueue=6), False)  # slot 2: claimed, void
        assert w._head == w.hdr[R.H_HEAD] == 2  # not advanced by the failed claim, as _claim leaves it
        assert w.write_task(TaskRecord(queue=QUEUE, seq=3, t_enqueue=7), False)  # slot 3
    if len(writers) == 2:
        assert writers[0]._mem[:] == writers[1]._mem[:]
    msgs = R.RingReader(writers[0]._mem).poll(10)
    assert [(m.index, m.kind) for m in msgs] == [(0, R.MSG_QUEUE), (1, R.MSG_TASK), (2, R.MSG_VOID), (3, R.MSG_TASK)]
    assert msgs[2].body == b""
    out: list[TaskRecord] = []
    decoder = Decoder()
    for msg in msgs:
        decoder.feed(msg, out)
    assert [r.seq for r in out] == [1, 3]


@pytest.mark.parametrize("commit", [R.COMMIT_STORE_ORDER, R.COMMIT_CRC])
def test_a_side_table_write_whose_claim_hint_fails_commits_its_slot_void(
        commit: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``_write`` (queue, request id, summary, consumer wait, error, resource, close) claims through ``_claim``:
    a claim hint that cannot be stored leaves the slot committed ``MSG_VOID`` (before: claimed and never
    committed, so the agent would stall on it), raises, and the next message goes to the next slot."""
    monkeypatch.setenv("OTEL_KVTRACE_RING_PACK", "python")
    w = _FailingHead(_ring(128, commit))
    w.fail = True
    with pytest.raises(RuntimeError, match="claim hint"):
        w.resource("a", 1)
    assert w.hdr[R.H_HEAD] == 0  # not advanced by the failed claim, as write_task leaves it
    w.resource("b", 2)
    msgs = R.RingReader(w._mem).poll(10)
    assert [(m.index, m.kind) for m in msgs] == [(0, R.MSG_VOID), (1, R.MSG_RESOURCE)]


@needs_native
def test_the_packer_refuses_claims_that_are_not_an_iterator_or_a_fold_that_is_not_callable() -> None:
    mem = _ring(128, R.COMMIT_STORE_ORDER)
    with pytest.raises(TypeError):  # PyIter_Next on a list would call a NULL tp_iternext
        NATIVE.Packer(mem, 128, 64, False, [0, 1, 2], R.fold_stages, TaskRecord)
    with pytest.raises(TypeError):
        NATIVE.Packer(mem, 128, 64, False, iter(range(3)), None, TaskRecord)


class _Hint:
    _head = 0


@needs_native
@pytest.mark.parametrize("claim", [-1, -129, (1 << 63) - 1, 1 << 63, 1 << 70])
def test_a_claim_outside_int64_commits_its_slot_void_and_writes_nowhere_else(claim: int) -> None:
    """A claim counter is ``itertools.count()`` in ``RingWriter``; ``Packer`` is public, so a claim that no
    slot commit word can hold (negative: before the mapping) is refused after committing its slot void."""
    mem = _ring(128, R.COMMIT_CRC)
    packer = NATIVE.Packer(mem, 128, 64, True, iter([claim]), R.fold_stages, TaskRecord)
    before = mem[:]
    with pytest.raises(OverflowError):
        packer.write(_Hint(), TaskRecord(queue=QUEUE), 0, R.NO_SUMMARY, False)
    idx = claim % 128
    off = R.HEADER_BYTES + idx * R.SLOT_SIZE
    commit, crc, kind, length = R.SLOT_HEAD.unpack_from(mem, off)
    assert (kind, length) == (R.MSG_VOID | R.KIND_WRITTEN, 0)
    assert commit == (claim + 1 + (1 << 63)) % (1 << 64) - (1 << 63)  # the claim + 1, modulo 2**64
    assert crc == R.slot_crc(b"", claim, kind, 0)
    assert mem[:off] == before[:off] and mem[off + 16 :] == before[off + 16 :]  # that slot's head only
    packer.release()


@needs_native
def test_inputs_left_to_python_claim_nothing_in_c() -> None:
    """What the C code does not take it returns as NotImplemented before any claim (ring untouched)."""
    writer = R.RingWriter(_ring(128, R.COMMIT_STORE_ORDER))
    before = writer._mem[:]
    for change in ({"t_enqueue": 1 << 63}, {"t_enqueue": 1.0}, {"kind": -1}, {"seq": "3"}, {"gate_id": 1 << 64},
                   {"deps": [0] * 9}, {"deps": (0,) * 10}, {"stages": [1, 2, 3.0]}, {"stages": {1, 2, 3}},
                   {"wait_for_save_layer": 1 << 31}, {"has_dep": -1}, {"final_layer": None}):
        rec = TaskRecord(queue=QUEUE)
        for name, value in change.items():
            setattr(rec, name, value)
        assert writer._packer.write(writer, rec, 0, R.NO_SUMMARY, False) is NotImplemented, change
    assert writer._packer.write(writer, TaskRecord(), 1 << 32, 0, False) is NotImplemented  # qidx not u32
    assert writer._mem[:] == before
    with pytest.raises(AttributeError):
        writer._packer.write(writer, object(), 0, 0, False)
    assert writer._mem[:] == before
    # Through write_task the Python path then raises as it always did (the recorder disables tracing).
    rec = TaskRecord(queue=QUEUE, t_enqueue=1 << 63)
    with pytest.raises(struct.error):
        writer.write_task(rec, False)


@needs_native
def test_records_of_other_types_and_unset_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    """``TaskRecord`` fields are read at their slot offsets; any other object through getattr, same bytes."""
    native, python = _pair(128, R.COMMIT_STORE_ORDER, monkeypatch)
    assert native._packer.record_type is TaskRecord

    class Plain:  # not a TaskRecord: every field by getattr
        def __init__(self, rec: TaskRecord) -> None:
            for f in dataclasses.fields(TaskRecord):
                setattr(self, f.name, getattr(rec, f.name))

    class Sub(TaskRecord):  # a subclass may redefine a field: not read by offset either
        __slots__ = ()

        @property
        def t_complete(self) -> int:  # type: ignore[override]
            return 77

        @t_complete.setter
        def t_complete(self, value: int) -> None:
            pass

    rec = TaskRecord(queue=QUEUE, seq=9, t_enqueue=5_000_000_123, stages=[1, 2, 3], gate_id=4)
    for make in (Plain, lambda r: Sub(**{f.name: getattr(r, f.name) for f in dataclasses.fields(TaskRecord)})):
        for w in (native, python):
            assert w.write_task(make(_copy(rec)), False) is True
        assert native._mem[:] == python._mem[:]
    out: list[TaskRecord] = []
    decoder = Decoder()
    for msg in R.RingReader(native._mem).poll(10):
        decoder.feed(msg, out)
    assert [r.t_complete for r in out] == [NO_TIME, 77]
    before = native._mem[:]
    unset = TaskRecord(queue=QUEUE)
    del unset.seq
    with pytest.raises(AttributeError):
        native._packer.write(native, unset, 0, 0, False)
    assert native._mem[:] == before  # nothing claimed


@needs_native
def test_the_packer_never_takes_a_mapping_smaller_than_its_slots() -> None:
    mem = _ring(128, R.COMMIT_STORE_ORDER)
    with pytest.raises(ValueError):
        NATIVE.Packer(mem, 129, 64, False, iter(range(10)), R.fold_stages, TaskRecord)
    with pytest.raises(ValueError):
        NATIVE.Packer(memoryview(mem)[4:], 127, 64, False, iter(range(10)), R.fold_stages, TaskRecord)  # misaligned
    with pytest.raises(BufferError):
        NATIVE.Packer(bytes(R.ring_bytes(4)), 4, 1, False, iter(range(10)), R.fold_stages, TaskRecord)  # read-only
    packer = NATIVE.Packer(mem, 128, 64, False, iter(range(10)), R.fold_stages, TaskRecord)
    packer.release()
    with pytest.raises(ValueError):
        packer.write(None, TaskRecord(), 0, 0, False)


@needs_native
def test_full_ring_claims_nothing_and_release_unmaps() -> None:
    writer = R.RingWriter(_ring(128, R.COMMIT_STORE_ORDER))
    rec = TaskRecord(queue=QUEUE, t_enqueue=1)
    written = 0
    while writer.write_task(rec, True):
        written += 1
    assert written == 128 - R.CLAIM_MARGIN - 1  # the queue definition took one slot
    assert writer.hdr[R.H_HEAD] == writer._head == 128 - R.CLAIM_MARGIN
    writer.release()  # the packer's buffer is released first, or the mapping could not close
    assert writer._mem.closed


def test_the_native_packer_is_in_use_when_it_can_be_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """So the suite cannot silently test only the Python path: where a compiler and the Python headers
    exist (this machine, CI) the extension must have been built by ``pip install -e .`` and be chosen."""
    require_built("otel_kvtrace.record._ringpack", "the Python path")
    monkeypatch.delenv("OTEL_KVTRACE_RING_PACK", raising=False)
    assert R.pack_mode() == ("native", "")
    writer = R.RingWriter(_ring(128, R.COMMIT_STORE_ORDER))
    assert type(writer._packer).__module__ == "otel_kvtrace.record._ringpack"
    calls = []
    real = writer._packer

    class Spy:  # counts the calls, the real packer writes
        def write(self, *args: Any) -> Any:
            calls.append(("write", args[1]))
            return real.write(*args)

        def ship(self, *args: Any) -> Any:
            calls.append(("ship", args[1]))
            return real.ship(*args)

        def remember_queue(self, *args: Any) -> Any:
            return real.remember_queue(*args)

    writer._packer = Spy()
    rec = TaskRecord(queue=QUEUE, seq=11, t_enqueue=5)
    assert writer.write_task(rec, False)
    assert calls == [("ship", rec), ("write", rec)]  # a queue ship() has not seen yet: the Python path's
    rec2 = TaskRecord(queue=QUEUE, seq=12, t_enqueue=6)
    assert writer.write_task(rec2, False)
    assert calls[2:] == [("ship", rec2)]  # the same queue again: ship() alone
    out: list[TaskRecord] = []
    decoder = Decoder()
    for msg in R.RingReader(writer._mem).poll(10):
        decoder.feed(msg, out)
    assert [r.seq for r in out] == [11, 12]


def test_python_is_forced_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_KVTRACE_RING_PACK", "python")
    assert R.pack_mode() == ("python", "OTEL_KVTRACE_RING_PACK=python")
    assert R.RingWriter(_ring(128, R.COMMIT_STORE_ORDER))._packer is None
    monkeypatch.setenv("OTEL_KVTRACE_RING_PACK", "bogus")  # warns, auto
    assert R.pack_mode()[0] == ("native" if NATIVE is not None else "python")


class _DeviceEvent:
    """A completed device event whose elapsed time since the calibration event is ``at_ms``."""

    def __init__(self, enable_timing: bool = True, at_ms: float = 0.0) -> None:
        self.at_ms = at_ms

    def record(self, *args: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: "_DeviceEvent") -> float:
        return other.at_ms - self.at_ms


@pytest.mark.parametrize("pack", ["auto", "python"])
def test_stream_bounds_are_applied_once_per_ship_with_device_timing(pack: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``write_task`` tightens the stream-order bounds, then hands the device-timing marks to the resolver
    (``Runtime.resolve``), which tightened the same stream marks again before; now it sees none of them."""
    from otel_kvtrace.instrument import runtime as runtime_mod
    from otel_kvtrace.instrument import stream_order
    from otel_kvtrace.instrument.npu_timing import NpuTiming
    from otel_kvtrace.record.model import Dep
    from otel_kvtrace.record.recorder import Recorder

    monkeypatch.setenv("OTEL_KVTRACE_RING_PACK", pack)
    applied: list[int] = []  # stream marks each tighten_bounds call walks (the real function does the work)

    def counting(record: Any) -> bool:
        applied.append(sum(type(m) is stream_order.StreamPosition for _, m in record.npu_marks))
        return stream_order.tighten_bounds(record)

    monkeypatch.setattr(R, "tighten_bounds", counting)
    monkeypatch.setattr(runtime_mod, "tighten_bounds", counting)
    recorder = Recorder(capacity=4, clock=lambda: 1_000_000)
    runtime = runtime_mod.Runtime(recorder=recorder, run_id="once")
    runtime.npu_timing = NpuTiming(_DeviceEvent, recorder.clock)  # calibration at host 1_000_000 ns
    recorder.npu_resolver = runtime.resolve
    writer = R.RingWriter(_ring(128, R.COMMIT_STORE_ORDER))
    recorder.attach_ring(writer)
    log = stream_order.StreamLog()
    for _ in range(3):
        log.append()
    log.observe(0, 1_000_500)
    log.observe(2, 1_000_400)  # recorded later, seen complete earlier: bounds position 0 at 1_000_400
    rec = recorder.new_record()
    rec.queue, rec.seq = QUEUE, 5
    rec.dep_bounds(Dep.SAVE_NPU, 1_000_100, 1_000_900)
    rec.dep_bounds(Dep.GATE_NPU, 1_000_000, 1_002_000)
    rec.npu_marks[:] = [(int(Dep.SAVE_NPU), stream_order.StreamPosition(log, 0)),
                        (int(Dep.GATE_NPU), _DeviceEvent(at_ms=0.0015))]  # device time 1_001_500
    recorder.submit(rec)
    assert recorder.enabled and recorder.submitted == 1
    assert sum(applied) == 1  # the one stream mark, once (it was 2: once here, once in Runtime.resolve)
    out: list[TaskRecord] = []
    decoder = Decoder()
    for msg in R.RingReader(writer._mem).poll(10):
        decoder.feed(msg, out)
    (got,) = out
    assert got.deps[2 * Dep.SAVE_NPU : 2 * Dep.SAVE_NPU + 2] == [1_000_100, 1_000_400]  # stream order
    assert got.deps[2 * Dep.GATE_NPU : 2 * Dep.GATE_NPU + 2] == [1_001_500, 1_001_500]  # device time


def test_doctor_names_the_packer_in_use(monkeypatch: pytest.MonkeyPatch) -> None:
    from otel_kvtrace.doctor import ring_pack

    monkeypatch.setenv("OTEL_KVTRACE_RING_PACK", "python")
    assert ring_pack() == "python: OTEL_KVTRACE_RING_PACK=python"
    monkeypatch.delenv("OTEL_KVTRACE_RING_PACK")
    assert ring_pack() == ("native" if NATIVE is not None else f"python: native packer {R._NATIVE_MISSING}")


def _perturbed(key: str, value: Any) -> Any:
    if key == "TASK_FIELDS":  # two fields swapped: a reordered TASK_FIELDS
        return (value[1], value[0], *value[2:])
    return value + "x" if isinstance(value, str) else value + 1


@needs_native
def test_every_layout_constant_the_c_code_copies_is_compared() -> None:
    """A stale in-place build (not rebuilt by a git pull) must not write another layout: each constant of
    ``_ringpack.LAYOUT`` and each field's offset and size is compared with ``ring.py``'s."""
    layout = NATIVE.LAYOUT
    assert R.layout_mismatch(layout) == ""
    assert set(layout) == set(R.native_layout())
    assert [name for name, _, _ in layout["TASK_FIELDS"]] == list(R.TASK_FIELDS)
    for key, value in layout.items():
        why = R.layout_mismatch({**layout, key: _perturbed(key, value)})
        assert why.startswith(f"{key} is "), (key, why)
    assert R.layout_mismatch({k: v for k, v in layout.items() if k != "F_GATE"}).startswith("F_GATE is None")
    assert R.layout_mismatch(None).startswith("no LAYOUT")


@needs_native
@pytest.mark.parametrize("change", [("VERSION", 4), ("F_AWAITING", 64), ("MAX_STAGE_INTS", 60),
                                    ("TASK_FIELDS", None)])
def test_a_build_stale_against_ring_py_is_not_used_and_logged_once(
        change: tuple[str, Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """ring.py changed after the build (a bumped VERSION, a flag bit, the stage cap, reordered fields): the
    real extension is then refused by ``_load_native`` and every writer uses Python, with one log line."""
    name, value = change
    if name == "TASK_FIELDS":
        fields = list(R.TASK_FIELDS)
        i, j = fields.index("src"), fields.index("gate")
        fields[i], fields[j] = fields[j], fields[i]
        value = tuple(fields)
    monkeypatch.setattr(R, name, value)
    native, why = R._load_native()
    assert native is None and why.startswith(f"stale build ({name} is "), why
    monkeypatch.setattr(R, "_NATIVE", native)
    monkeypatch.setattr(R, "_NATIVE_MISSING", why)
    monkeypatch.setattr(R, "_WARNED", set())
    monkeypatch.delenv("OTEL_KVTRACE_RING_PACK", raising=False)
    with caplog.at_level("WARNING", logger="otel_kvtrace"):
        writers = [R.RingWriter(_ring(128, R.COMMIT_STORE_ORDER)) for _ in range(2)]
    assert [w._packer for w in writers] == [None, None]
    assert R.pack_mode() == ("python", f"native packer {why}")
    assert [r.getMessage() for r in caplog.records] == [
        f"otel-kvtrace: OTEL_KVTRACE_RING_PACK=auto: native packer {why}; using the Python packer"]


def test_a_packer_that_cannot_be_constructed_leaves_the_python_packer_and_one_log_line(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """``RingWriter`` is built in ``agent_link._spawn`` after the agent process started: a ``Packer`` that
    raises (here the real one, refusing a header that names more slots than the mapping holds) must not
    break tracing start; ``pack_mode`` (and so ``kvtrace doctor``) says why."""
    if NATIVE is None:
        pytest.skip(f"native packer {R._NATIVE_MISSING}")
    monkeypatch.setattr(R, "_NATIVE_FAILED", "")
    monkeypatch.setattr(R, "_WARNED", set())
    monkeypatch.delenv("OTEL_KVTRACE_RING_PACK", raising=False)
    mem = _ring(128, R.COMMIT_STORE_ORDER)
    hdr = memoryview(mem)[: R.HEADER_BYTES].cast("q")
    hdr[R.H_NSLOTS] = 129  # the real Packer checks its mapping: ValueError
    hdr.release()
    with caplog.at_level("WARNING", logger="otel_kvtrace"):
        writer = R.RingWriter(mem)
        again = R.RingWriter(_ring(128, R.COMMIT_STORE_ORDER))  # this process stays on Python, no 2nd line
    assert writer._packer is None and again._packer is None
    mode, why = R.pack_mode()
    assert mode == "python" and why.startswith("native packer failed: ValueError: ring mapping smaller"), why
    assert len(caplog.records) == 1 and "native ring packer failed (ValueError" in caplog.records[0].getMessage()
    assert writer.write_task(TaskRecord(queue=QUEUE, seq=4, t_enqueue=5), False)  # the Python path writes
    out: list[TaskRecord] = []
    decoder = Decoder()
    for msg in R.RingReader(writer._mem).poll(10):
        decoder.feed(msg, out)
    assert [r.seq for r in out] == [4]


@pytest.mark.parametrize("want", ["native", "auto"])
def test_native_asked_for_but_missing_warns_once(want: str, monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """``=native`` without the extension: one warning per process (``auto``: silent, the normal case
    without a compiler); the Python packer either way."""
    monkeypatch.setattr(R, "_NATIVE", None)
    monkeypatch.setattr(R, "_NATIVE_MISSING", "not built (No module named 'otel_kvtrace.record._ringpack')")
    monkeypatch.setattr(R, "_WARNED", set())
    monkeypatch.setenv("OTEL_KVTRACE_RING_PACK", want)
    with caplog.at_level("WARNING", logger="otel_kvtrace"):
        modes = [R.pack_mode() for _ in range(3)]
        assert R.RingWriter(_ring(128, R.COMMIT_STORE_ORDER))._packer is None
    assert modes == [("python", f"native packer {R._NATIVE_MISSING}")] * 3
    expected = [f"otel-kvtrace: OTEL_KVTRACE_RING_PACK=native: native packer {R._NATIVE_MISSING}; "
                "using the Python packer"] if want == "native" else []
    assert [r.getMessage() for r in caplog.records] == expected


# -- Packer.ship: write_task's common case in C -------------------------------------------------------------
_SHARED = [FakeShared([f"r{i}", "rB"], list(range(4 + i)), [True, False], []) for i in range(3)]
_QUEUES = [QUEUE, QueueInfo(run_id="pack", path="gva", thread_name="KVCacheRecvThread2", pid=7, tp=1, num_layers=8)]


@st.composite
def stream_logs(draw: Any) -> Any:
    from otel_kvtrace.instrument.stream_order import StreamLog

    log = StreamLog(done_by=draw(st.lists(st.one_of(st.integers(0, 1 << 62), st.integers(*I64)), max_size=80)))
    log.observed = draw(st.one_of(st.integers(-1, len(log.done_by) - 1), st.integers(-2, len(log.done_by) + 2)))
    return log


@st.composite
def shipped(draw: Any) -> tuple[TaskRecord, bool]:
    """A record as the recv thread ships it: stream marks over generated step logs (positions in and out of
    range, a window longer than MAX_SCAN, a few marks of another type), transfer tasks sharing one of a few
    ``SharedBlockData``-like objects (a new one, the one of the last summary, several tasks, none), one of two
    queues, and the values ``records()`` draws (errors, out-of-range fields)."""
    from otel_kvtrace.instrument.stream_order import StreamPosition

    rec, awaiting, _summary = draw(records())
    rec.queue = _QUEUES[draw(st.integers(0, 9)) == 0]  # mostly the queue ship() has seen last
    if draw(st.integers(0, 2)):
        rec.error = None  # records() fails one in ten; ship() leaves those to Python
    logs = draw(st.lists(stream_logs(), min_size=1, max_size=2))
    for _ in range(draw(st.integers(0, 4))):
        log = draw(st.sampled_from(logs))
        dep = draw(st.integers(0, NUM_DEPS - 1))
        if draw(st.integers(0, 14)) == 0:
            rec.npu_marks.append((dep, object()))  # not a stream mark: the Python path's (no resolver here)
        else:
            n = len(log.done_by)
            where = draw(st.one_of(st.integers(0, max(n - 1, 0)), st.integers(-1, n + 1)))
            rec.npu_marks.append((dep, StreamPosition(log, where)))
    shape = draw(st.integers(0, 3))
    if shape:
        often = st.one_of(st.just(0), st.just(0), st.just(0), st.integers(0, 2))  # mostly the last summary's
        tasks = [FakeLayerTransferTask(group_id=draw(often), layer_idx_in_group=1, shared_block_data=_SHARED[draw(often)])
                 for _ in range(1 if shape < 3 else 2)]
        rec.transfer_tasks = tasks[0] if shape == 1 else tasks
    return rec, awaiting


def _copy_marks(rec: TaskRecord) -> TaskRecord:
    twin = _copy(rec)
    twin.npu_marks = list(rec.npu_marks)  # the same step logs: tightening reads them, never writes them
    twin.transfer_tasks = rec.transfer_tasks
    return twin


@needs_native
@pytest.mark.parametrize("commit", [R.COMMIT_STORE_ORDER, R.COMMIT_CRC])
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.lists(st.tuples(shipped(), st.booleans()), min_size=1, max_size=40))
def test_ship_writes_what_the_python_path_writes(commit: int, batch: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """``Packer.ship`` (the queue, error, stream-bound and summary steps in C) against ``write_task``'s Python
    path: the same result, the same ring bytes after every write, the same tightened bounds on the record,
    and the same decoded tasks."""
    native, python = _pair(128, commit, monkeypatch)
    readers = [R.RingReader(native._mem), R.RingReader(python._mem)]
    decoders = [Decoder(), Decoder()]
    for (rec, awaiting), consume in batch:
        twins = [_copy_marks(rec), _copy_marks(rec)]
        results = [_write(w, twin, awaiting, None) for w, twin in zip((native, python), twins)]
        assert results[0] == results[1]
        assert twins[0].deps == twins[1].deps and twins[0].has_dep == twins[1].has_dep
        assert native._mem[:] == python._mem[:]
        assert native._head == python._head
        if consume:
            assert _decoded(readers[0], decoders[0]) == _decoded(readers[1], decoders[1])
    assert decoders[0].malformed == decoders[1].malformed == 0


@needs_native
def test_ship_takes_the_common_task_and_leaves_the_rest_to_python(monkeypatch: pytest.MonkeyPatch) -> None:
    """So the test above compares two paths, not one: ship() writes the recv thread's common task itself
    (stream marks, shared transfer data seen before) and declines a new queue, an error, another mark type
    and new shared data (NotImplemented, nothing claimed)."""
    from otel_kvtrace.instrument.stream_order import StreamLog, StreamPosition

    native, _python = _pair(128, R.COMMIT_STORE_ORDER, monkeypatch)
    packer = native._packer
    log = StreamLog(done_by=[100, 90, 300], observed=2)
    task = FakeLayerTransferTask(group_id=0, layer_idx_in_group=1, shared_block_data=_SHARED[0])

    def rec(**kw: Any) -> TaskRecord:
        r = TaskRecord(**{"queue": QUEUE, "seq": 1, "transfer_tasks": task, **kw})
        r.deps[2 * 2 : 2 * 2 + 2] = [10, 1000]
        r.npu_marks.append((2, StreamPosition(log, 0)))
        return r

    assert packer.ship(native, rec(), False) is NotImplemented  # queue not resolved yet
    assert native.write_task(rec(), False)  # the Python path: the queue and the summary are now known
    head = native._head
    common = rec()
    assert packer.ship(native, common, False) is True and native._head == head + 1
    assert common.deps[5] == 90 and common.has_dep == 1 << 2  # min(100, 90, 300), over its lower bound 10
    declined = [rec(error=ValueError("x")), rec(transfer_tasks=[task, task]),
                rec(transfer_tasks=FakeLayerTransferTask(0, 1, _SHARED[1])),
                TaskRecord(queue=_QUEUES[1])]
    declined[0].npu_marks.append((1, object()))
    for r in declined:
        assert packer.ship(native, r, False) is NotImplemented
    assert native._head == head + 1


# -- the native shipper (``_ringpack.Shipper``) against ``Recorder._ship`` ----------------------------------------


def _fields(rec: TaskRecord) -> list[tuple[str, type, Any]]:
    """Every field of ``rec``: name, type and value (so ``True`` is not ``1``)."""
    return [(f.name, type(getattr(rec, f.name)), getattr(rec, f.name)) for f in dataclasses.fields(rec)]


def _lists(rec: TaskRecord) -> list[int]:
    return [id(rec.stages), id(rec.deps), id(rec.npu_marks), id(rec.holds)]


@st.composite
def used_records(draw: Any) -> TaskRecord:
    """A record as the recorder recycles it: every field set, the fields ``records()`` leaves alone too."""
    rec = draw(records())[0]
    rec.transfer_tasks = draw(st.sampled_from([None, object(), [1, 2]]))
    rec.npu_marks.extend((draw(st.integers(0, 4)), object()) for _ in range(draw(st.integers(0, 3))))
    rec.holds.extend(draw(st.lists(st.integers(0, 1), max_size=2)))
    rec.consumer_release = draw(st.integers(0, 3))
    rec.error = draw(st.sampled_from([None, ValueError("x")]))
    return rec


def _shipper_pair(nslots: int, commit: int, monkeypatch: pytest.MonkeyPatch,
                  cls: Any = R.RingWriter) -> tuple[Any, Any]:
    """(recorder shipping through the native shipper, recorder shipping through ``Recorder._ship`` and the
    Python packer), each on its own fresh ring of the same shape."""
    from otel_kvtrace.record.recorder import Recorder

    native, python = _pair(nslots, commit, monkeypatch, cls)
    recorders = (Recorder(capacity=4), Recorder(capacity=4))
    for recorder, writer in zip(recorders, (native, python)):
        recorder.attach_ring(writer)
    assert type(recorders[0].submit) is NATIVE.Shipper and type(recorders[0].submit_first) is NATIVE.Shipper
    assert type(recorders[1].submit).__name__ == "partial"  # the reference: no packer, no shipper
    return recorders


@needs_native
@settings(max_examples=120, deadline=None)
@given(rec=used_records())
def test_the_shippers_reset_is_taskrecord_reset(rec: TaskRecord) -> None:
    """The reset of a recycled record in C (every field from a blank record, lists kept and refilled) equals
    ``TaskRecord.reset``, field by field and type by type, and keeps the record's own lists."""
    from otel_kvtrace.record.recorder import Recorder

    fd, mem = R.create_memfd(128)
    os.close(fd)
    writer = R.RingWriter(mem)
    shipper = writer.native_shipper(Recorder(), False)
    twin = dataclasses.replace(rec, stages=list(rec.stages), deps=list(rec.deps), npu_marks=list(rec.npu_marks),
                               holds=list(rec.holds))
    lists = _lists(rec)
    shipper.reset(rec)
    twin.reset()
    assert _fields(rec) == _fields(twin) == _fields(TaskRecord())
    assert _lists(rec) == lists
    rec.stages = (1, 2, 3)  # not a list: TaskRecord.reset itself runs (and raises, as it does)
    with pytest.raises(AttributeError):
        shipper.reset(rec)
    assert rec.stages == (1, 2, 3) and rec.queue is None


def _recorder_state(recorder: Any) -> tuple[Any, ...]:
    return (recorder.submitted, recorder.dropped, recorder.disabled_reason, recorder.pending,
            [_fields(r) for r in recorder._pool])


@needs_native
@pytest.mark.parametrize("commit", [R.COMMIT_STORE_ORDER, R.COMMIT_CRC])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.lists(st.tuples(shipped(), st.integers(0, 2)), min_size=1, max_size=60))
def test_the_native_shipper_ships_what_recorder_ship_ships(
        commit: int, batch: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """``submit``/``submit_first`` in C against ``Recorder._ship`` (the Python packer behind it): after every
    task the same ring bytes, claim hint, submitted and dropped counts (a ring of 128 slots not drained fills:
    drops), disabled reason (records the Python path raises on), in-process hand-off, and pool: the same
    recycled records, reset alike; an awaiting task is not recycled by either."""
    recorders = _shipper_pair(128, commit, monkeypatch)
    writers = [r.ring for r in recorders]
    readers = [R.RingReader(w._mem) for w in writers]
    for (rec, awaiting), consume in batch:
        twins = [_copy_marks(rec), _copy_marks(rec)]
        for recorder, twin in zip(recorders, twins):
            (recorder.submit_first if awaiting else recorder.submit)(twin)
        assert writers[0]._mem[:] == writers[1]._mem[:]
        assert writers[0]._head == writers[1]._head
        assert _recorder_state(recorders[0]) == _recorder_state(recorders[1])
        assert _fields(twins[0]) == _fields(twins[1])
        if consume == 0:
            for reader in readers:
                reader.poll(10_000)
                reader.consumed()


@needs_native
def test_common_tasks_are_shipped_and_recycled_in_c_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison above would also pass if the shipper always fell back to ``Recorder._ship``: here
    the Python path is made to fail, and tasks of a known queue are shipped until the ring is full, so
    both the shipped (recycled) and the ring-full (dropped) cases run in C alone."""
    from otel_kvtrace.record.recorder import Recorder

    native, _ = _shipper_pair(128, R.COMMIT_STORE_ORDER, monkeypatch)
    native.ring.write_task(TaskRecord(queue=QUEUE, seq=0, t_enqueue=1), False)  # the queue is known now

    def python_path(*_args: Any, **_kwargs: Any) -> None:
        raise AssertionError("the Python path ran")

    monkeypatch.setattr(Recorder, "_ship", python_path)
    for seq in range(1, 200):
        native.submit(TaskRecord(queue=QUEUE, seq=seq, t_enqueue=10 + seq))
    assert native.disabled_reason is None
    assert native.submitted > 0 and native.dropped > 0 and native.submitted + native.dropped == 199
    assert len(native._pool) == 4  # recycled, up to the pool's capacity


@needs_native
def test_an_uninitialised_shipper_raises_instead_of_crashing() -> None:
    for call in (lambda s: s(TaskRecord()), lambda s: s.reset(TaskRecord())):
        with pytest.raises(TypeError, match="not initialised"):
            call(NATIVE.Shipper.__new__(NATIVE.Shipper))


@needs_native
@pytest.mark.parametrize("commit", [R.COMMIT_STORE_ORDER, R.COMMIT_CRC])
def test_a_failed_native_ship_disables_tracing_as_recorder_ship_does(
        commit: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A claim hint that cannot be stored (an exception after the claim): the slot is committed void, tracing
    turns off with the same reason, the task counts as dropped and its record is recycled, in both."""
    recorders = _shipper_pair(128, commit, monkeypatch, _FailingHead)
    for recorder in recorders:
        recorder.ring.write_task(TaskRecord(queue=QUEUE, seq=1, t_enqueue=5), False)  # the queue is known now
        recorder.ring.fail = True
        recorder.submit(TaskRecord(queue=QUEUE, seq=2, t_enqueue=6))
    assert recorders[0].disabled_reason == "ring write failed: RuntimeError('claim hint not stored')"
    assert _recorder_state(recorders[0]) == _recorder_state(recorders[1])
    assert recorders[0].dropped == 1 and len(recorders[0]._pool) == 1
    assert recorders[0].ring._mem[:] == recorders[1].ring._mem[:]


@needs_native
def test_the_native_shipper_leaves_a_detached_ring_to_recorder_ship(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shut down while a recording thread still holds ``submit``: the record goes in-process, as ``_ship``
    sends it, and nothing is written to the ring any more; a fork re-attaches a fresh shipper."""
    recorder, _reference = _shipper_pair(128, R.COMMIT_STORE_ORDER, monkeypatch)
    writer = recorder.ring
    submit = recorder.submit
    recorder.ring = None
    rec = TaskRecord(queue=QUEUE, seq=9)
    submit(rec)
    assert recorder.pending == 1 and recorder.drain(1) == [rec] and writer._head == 0
    recorder.ring = writer
    recorder.after_fork()
    assert recorder.submit is not submit and type(recorder.submit) is NATIVE.Shipper
    recorder.submit(TaskRecord(queue=QUEUE, seq=10))
    assert recorder.submitted == 1  # the child's counter, not the parent's


# -- the forward's release (``_ringpack.Releaser``) against ``Recorder.submit_consumer`` -----------------------------
CW = 8  # model.Stage.CONSUMER_WAIT
_OTHER_QUEUE = QueueInfo(run_id="pack", path="gva", thread_name="never-sent", pid=7, tp=1, num_layers=8)


@st.composite
def released(draw: Any) -> tuple[TaskRecord, Any]:
    """A record the forward releases (its stages: the recv thread's and the forward's consumer waits, some
    past the 8 triples a ``MSG_CWAIT`` carries) and the reason; a few inputs the C code leaves to Python."""
    rec = TaskRecord()
    rec.queue = draw(st.sampled_from([QUEUE, QUEUE, QUEUE, _OTHER_QUEUE]))
    rec.seq = draw(st.integers(*I64))
    for _ in range(draw(st.one_of(st.integers(0, 6), st.integers(7, 24)))):
        rec.stages.extend((draw(st.one_of(st.just(CW), st.integers(0, 9))), draw(stamp), draw(stamp)))
    rec.holds.extend(draw(st.lists(st.integers(0, 1), max_size=2)))
    rec.transfer_tasks = draw(st.sampled_from([None, object()]))
    reason = draw(st.integers(0, 3))
    bad = draw(st.integers(0, 29))
    if bad == 0:
        rec.stages.append(CW)  # a partial triple: not a stage of consumer_stages
    elif bad == 1 and rec.stages:
        rec.stages[0] = 8.0  # == CW in Python: packed, and struct refuses a float
    elif bad == 2:
        rec.stages.extend((CW, 1 << 63, 5))  # out of int64: struct.error if it is within the first 8
    elif bad == 3:
        rec.stages.extend((3, 1.5, "x"))  # not a consumer wait: never packed, never checked
    elif bad == 4:
        rec.seq = 1 << 63
    elif bad == 5:
        reason = draw(st.sampled_from([256, -1, True]))
    elif bad == 6:
        rec.stages = tuple(rec.stages)
    elif bad == 7:
        rec.stages.extend((1 << 70, 1, 2))  # a stage id past int64: not a consumer wait
    return rec, reason


def _released_twin(rec: TaskRecord) -> TaskRecord:
    stages = list(rec.stages) if type(rec.stages) is list else rec.stages
    return dataclasses.replace(rec, stages=stages, deps=list(rec.deps), npu_marks=[], holds=list(rec.holds))


def _release_pair(commit: int, monkeypatch: pytest.MonkeyPatch, cls: Any = R.RingWriter) -> tuple[Any, Any]:
    recorders = _shipper_pair(128, commit, monkeypatch, cls)
    for recorder in recorders:
        assert recorder.ring.write_task(TaskRecord(queue=QUEUE, seq=0, t_enqueue=1), True)  # the queue is known
    assert type(recorders[0].submit_consumer) is NATIVE.Releaser
    assert "submit_consumer" not in recorders[1].__dict__  # the reference: Recorder.submit_consumer itself
    return recorders


@needs_native
@pytest.mark.parametrize("commit", [R.COMMIT_STORE_ORDER, R.COMMIT_CRC])
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.lists(st.tuples(released(), st.integers(0, 3)), min_size=1, max_size=80))
def test_the_native_releaser_writes_what_submit_consumer_writes(
        commit: int, batch: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """``submit_consumer`` in C against ``Recorder.submit_consumer`` (the Python ``write_cwait`` and
    ``consumer_stages`` behind it): after every release the same ring bytes, claim hint, counts, disabled
    reason (the inputs Python raises on), pool (the same recycled records, reset alike) and record; a ring of
    128 slots not drained fills (the consumer wait is then not written, and not counted, by either)."""
    recorders = _release_pair(commit, monkeypatch)
    writers = [r.ring for r in recorders]
    readers = [R.RingReader(w._mem) for w in writers]
    decoders = [Decoder(), Decoder()]
    for (rec, reason), consume in batch:
        twins = [_released_twin(rec), _released_twin(rec)]
        raised = []
        for recorder, twin in zip(recorders, twins):
            try:
                recorder.submit_consumer(twin, reason)
                raised.append(None)
            except Exception as exc:  # noqa: BLE001 - a tuple of stages: reset() raises after the write, in both
                raised.append(type(exc))
        assert raised[0] == raised[1]
        assert writers[0]._mem[:] == writers[1]._mem[:]
        assert writers[0]._head == writers[1]._head
        assert _recorder_state(recorders[0]) == _recorder_state(recorders[1])
        assert _fields(twins[0]) == _fields(twins[1])
        if consume == 0:
            got = []
            for reader, decoder in zip(readers, decoders):
                out: list[TaskRecord] = []
                for msg in reader.poll(10_000):
                    decoder.feed(msg, out)
                reader.consumed()
                got.append([_fields(r) for r in out])
            assert got[0] == got[1]


def _cwait_messages(writer: Any) -> list[tuple[int, int, int, list[int]]]:
    out = []
    for msg in R.RingReader(writer._mem).poll(10_000):
        if msg.kind == R.MSG_CWAIT:
            qidx, seq, reason, n = R.CWAIT_FIXED.unpack_from(msg.body)
            out.append((qidx, seq, reason, list(struct.unpack_from(f"@{n}n", msg.body, R.CWAIT_FIXED.size))))
    return out


@needs_native
def test_common_releases_are_written_and_recycled_in_c_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison above would also pass if the releaser always fell back to ``Recorder.submit_consumer``:
    here that reference raises, and common releases run until the ring is full, so the written, ring-full and
    unknown-queue cases run in C alone; what is written is ``write_cwait``'s message."""
    from otel_kvtrace.record.recorder import Recorder

    def reference(*_args: Any, **_kwargs: Any) -> None:
        raise AssertionError("the Python path ran")

    monkeypatch.setattr(Recorder, "submit_consumer", reference)  # before attach_ring: it is the fallback
    native, _ = _release_pair(R.COMMIT_STORE_ORDER, monkeypatch)
    for seq in range(1, 100):
        rec = TaskRecord(queue=QUEUE if seq % 10 else _OTHER_QUEUE, seq=seq)
        rec.stages.extend((2, 5, 6, CW, 10 * seq, 10 * seq + 7, 3, 8, 9))
        native.submit_consumer(rec, seq % 4)
    assert native.disabled_reason is None and native.submitted == 0 and native.dropped == 0
    assert len(native._pool) == 4  # recycled, up to the pool's capacity
    assert all(_fields(r) == _fields(TaskRecord()) for r in native._pool)
    msgs = _cwait_messages(native.ring)
    assert len(msgs) == 62  # 128 slots - 64 spare - the queue and the task written first
    assert msgs[:2] == [(0, 1, 1, [CW, 10, 17]), (0, 2, 2, [CW, 20, 27])]


@needs_native
@pytest.mark.parametrize("commit", [R.COMMIT_STORE_ORDER, R.COMMIT_CRC])
def test_a_failed_native_release_disables_tracing_as_submit_consumer_does(
        commit: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A claim hint that cannot be stored: the slot is committed void, tracing turns off with the same
    reason and the record is recycled, in both; the next release is written to the next slot."""
    recorders = _release_pair(commit, monkeypatch, _FailingHead)
    for recorder in recorders:
        recorder.ring.fail = True
        recorder.submit_consumer(TaskRecord(queue=QUEUE, seq=2, stages=[CW, 1, 2]), 0)
        recorder.submit_consumer(TaskRecord(queue=QUEUE, seq=3, stages=[CW, 3, 4]), 0)
    assert recorders[0].disabled_reason == "ring write failed: RuntimeError('claim hint not stored')"
    assert _recorder_state(recorders[0]) == _recorder_state(recorders[1])
    assert len(recorders[0]._pool) == 2
    assert recorders[0].ring._mem[:] == recorders[1].ring._mem[:]
    kinds = [m.kind for m in R.RingReader(recorders[0].ring._mem).poll(10)]
    assert kinds == [R.MSG_QUEUE, R.MSG_TASK, R.MSG_VOID, R.MSG_CWAIT]


@needs_native
def test_the_native_releaser_leaves_a_detached_ring_to_submit_consumer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shut down while the forward still holds ``submit_consumer``: the record goes in-process with its
    reason, as ``Recorder.submit_consumer`` sends it; detaching removes the releaser, a fork makes a new one."""
    recorder, _reference = _release_pair(R.COMMIT_STORE_ORDER, monkeypatch)
    writer = recorder.ring
    release = recorder.submit_consumer
    head = writer._head
    recorder.ring = None
    rec = TaskRecord(queue=QUEUE, seq=9, stages=[CW, 1, 2])
    release(rec, 2)
    assert recorder.pending == 1 and recorder.drain(1) == [rec] and rec.consumer_release == 2
    assert writer._head == head
    recorder.ring = writer
    recorder.after_fork()
    assert recorder.submit_consumer is not release and type(recorder.submit_consumer) is NATIVE.Releaser
    recorder.attach_ring(None)
    assert "submit_consumer" not in recorder.__dict__


@needs_native
def test_an_uninitialised_or_misused_releaser_raises_instead_of_crashing(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(TypeError, match="not initialised"):
        NATIVE.Releaser.__new__(NATIVE.Releaser)(TaskRecord(), 0)
    recorder, _ = _release_pair(R.COMMIT_STORE_ORDER, monkeypatch)
    with pytest.raises(TypeError, match="recycles"):
        NATIVE.Releaser(recorder.submit_first, print)  # the awaiting shipper never recycles
    with pytest.raises(TypeError, match="submit_consumer"):
        recorder.submit_consumer(TaskRecord())


def test_the_native_releaser_is_in_use_when_it_can_be_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the extension can be built, a recorder attached to a ring releases through it; forced Python
    (``OTEL_KVTRACE_RING_PACK=python``), through ``Recorder.submit_consumer``."""
    from otel_kvtrace.record.recorder import Recorder

    require_built("otel_kvtrace.record._ringpack", "Recorder.submit_consumer")
    monkeypatch.delenv("OTEL_KVTRACE_RING_PACK", raising=False)
    recorder = Recorder()
    recorder.attach_ring(R.RingWriter(_ring(128, R.COMMIT_STORE_ORDER)))
    assert type(recorder.submit_consumer).__module__ == "otel_kvtrace.record._ringpack"
    monkeypatch.setenv("OTEL_KVTRACE_RING_PACK", "python")
    recorder.attach_ring(R.RingWriter(_ring(128, R.COMMIT_STORE_ORDER)))
    assert recorder.submit_consumer.__func__ is Recorder.submit_consumer


@settings(max_examples=200, deadline=None)
@given(stages=st.lists(st.one_of(st.just(CW), st.integers(0, 9), st.integers(*I64)), max_size=60))
def test_consumer_stages_is_the_loop_it_replaced(stages: list[int]) -> None:
    """``ring.consumer_stages`` (the reference the C code follows) against the loop it was written as."""
    out: list[int] = []
    for i in range(0, len(stages) - 2, 3):
        if stages[i] == CW:
            out += stages[i : i + 3]
    assert R.consumer_stages(stages) == out
