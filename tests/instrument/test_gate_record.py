"""The gate's record wrapper: the native ``_probes.GateRecord`` does what its rule (``wrappers.gate_record_rule``,
installed when the extension is not built) does, for every kind of gate, runtime state and failure: the same
stamp (time, stream position, device mark), the same stream log, the same call of the original, the same
``rt.fail`` and the same exception to the caller; and it binds as a method of the gate class, as the rule's
function does."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from otel_kvtrace.instrument import attach, patches, wrappers
from otel_kvtrace.instrument.stream_order import FAR_FUTURE, MAX_EVENTS_PER_LOG, StreamLog, StreamPosition
from tests.instrument.test_enqueue_take import Gate, SlottedGate
from tests.native import require_built

STAMP = wrappers.GATE_STAMP_ATTR


@dataclass
class FakeRecorder:
    enabled: bool = True
    ticks: list[int] = field(default_factory=lambda: [1000])
    raises: BaseException | None = None

    def clock(self) -> int:
        if self.raises is not None:
            raise self.raises
        self.ticks[0] += 7
        return self.ticks[0]


@dataclass
class FakeRuntime:
    recorder: FakeRecorder = field(default_factory=FakeRecorder)
    stream_log: StreamLog = field(default_factory=StreamLog)
    npu_timing_wanted: bool = False
    failures: list[BaseException] = field(default_factory=list)

    def fail(self, exc: BaseException) -> None:
        self.failures.append(exc)


class EventGate(Gate):
    def __init__(self) -> None:
        self._event = object()  # recorded already: a later record() is not the first


def raising_gate(attr: str, exc: BaseException) -> type:
    """A gate class whose read of ``attr`` raises ``exc`` (AttributeError: the rule's "none"; others: raised)."""

    def __getattribute__(self: Any, name: str) -> Any:
        if name == attr:
            raise exc
        return object.__getattribute__(self, name)

    return type(f"Raising_{attr.strip('_')}", (Gate,), {"__getattribute__": __getattribute__})


RaisingEventGate = raising_gate("_event", RuntimeError("no event here"))
NoDictGate = raising_gate("__dict__", AttributeError("no dict here"))
DictErrorGate = raising_gate("__dict__", RuntimeError("dict read failed"))


class Mark:
    """A device-timing mark (compared by identity)."""


MARK = Mark()


class Timing:
    def mark(self, *args: Any, **kwargs: Any) -> Mark:
        return MARK


def _stamp_of(gate: Any) -> Any:
    try:
        return object.__getattribute__(gate, "__dict__").get(STAMP)
    except AttributeError:  # slotted
        return None


def _run(make_wrapper: Any, gate_class: type, rt: FakeRuntime, original_raises: BaseException | None,
         args: tuple, kwargs: dict) -> dict[str, Any]:
    calls: list[tuple] = []

    def record(self: Any, *a: Any, **k: Any) -> str:
        calls.append((self, a, k, _stamp_of(self)))
        if original_raises is not None:
            raise original_raises
        return "recorded"

    members = {"record": make_wrapper(record, rt)}
    if "__slots__" in vars(gate_class):
        members["__slots__"] = ()  # a slotted gate stays without __dict__
    gate = type("G", (gate_class,), members)()
    log = rt.stream_log
    out: dict[str, Any] = {}
    try:
        out["result"] = gate.record(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - the exception is the outcome compared
        out["raised"] = (type(exc), exc.args)
    stamp = _stamp_of(gate)
    if stamp is not None and type(stamp[1]) is StreamPosition:
        rec, pos, mark = stamp
        stamp = (rec, type(pos), pos.log is rt.stream_log, pos.log is log, pos.position, mark)
    out["stamp"] = stamp
    out["calls"] = [(a, k, c is not None) for _, a, k, c in calls]  # whether the stamp was there before the call
    out["log"] = (rt.stream_log is log, list(rt.stream_log.done_by), rt.stream_log.observed)
    out["failures"] = [(type(e), e.args) for e in rt.failures]
    return out


def _native(original: Any, rt: Any) -> Any:
    return wrappers.NATIVE_GATE_RECORD(original, rt, rt.recorder.clock, wrappers.gate_record_rule(original, rt),
                                       STAMP, StreamLog, StreamPosition, MAX_EVENTS_PER_LOG, FAR_FUTURE)


def _both(make_gate: Any, make_rt: Any, original_raises: BaseException | None = None,
          args: tuple = ("stream",), kwargs: dict | None = None) -> dict[str, Any]:
    results = [_run(make, make_gate, make_rt(), original_raises, args, kwargs or {})
               for make in (wrappers.gate_record_rule, _native)]
    assert results[0] == results[1]
    return results[0]


@pytest.fixture(autouse=True)
def _built() -> None:
    require_built("otel_kvtrace.instrument._probes", "the Python gate record wrapper")
    assert wrappers.NATIVE_GATE_RECORD is not None


def test_first_record_is_stamped_before_the_original_runs() -> None:
    out = _both(Gate, FakeRuntime, args=("s",), kwargs={"k": 1})
    assert out["result"] == "recorded"
    assert out["stamp"] == (1007, StreamPosition, True, True, 0, None)
    assert out["calls"] == [(("s",), {"k": 1}, True)]
    assert out["log"] == (True, [FAR_FUTURE], -1)


def test_no_stamp_for_a_recorded_gate_a_stamped_one_a_slotted_one_or_a_disabled_recorder() -> None:
    class Stamped(Gate):
        def __init__(self) -> None:
            super().__init__()
            self.__dict__[STAMP] = (1, 2, 3)

    for make_gate, make_rt in ((EventGate, FakeRuntime), (SlottedGate, FakeRuntime), (NoDictGate, FakeRuntime),
                               (Gate, lambda: FakeRuntime(FakeRecorder(enabled=False)))):
        out = _both(make_gate, make_rt)
        assert out["stamp"] is None and out["log"] == (True, [], -1) and len(out["calls"]) == 1
    out = _both(Stamped, FakeRuntime)
    assert out["stamp"] == (1, 2, 3) and out["log"] == (True, [], -1) and out["failures"] == []


def test_a_full_log_starts_a_new_one() -> None:
    def full() -> FakeRuntime:
        rt = FakeRuntime()
        rt.stream_log.done_by.extend([5] * MAX_EVENTS_PER_LOG)
        return rt

    out = _both(Gate, full)
    assert out["stamp"] == (1007, StreamPosition, True, False, 0, None)
    assert out["log"] == (False, [FAR_FUTURE], -1)


def test_a_wanted_device_mark_goes_to_the_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attach, "npu_timing_for", lambda rt: Timing())
    out = _both(Gate, lambda: FakeRuntime(npu_timing_wanted=True))
    assert out["stamp"] == (1007, StreamPosition, True, True, 0, MARK)


def test_failures_turn_tracing_off_or_reach_the_caller_as_the_rule_lets_them() -> None:
    out = _both(Gate, lambda: FakeRuntime(FakeRecorder(raises=ValueError("clock"))))
    assert out["failures"] == [(ValueError, ("clock",))] and out["result"] == "recorded" and out["stamp"] is None
    out = _both(Gate, lambda: FakeRuntime(FakeRecorder(raises=KeyboardInterrupt())))
    assert out["raised"] == (KeyboardInterrupt, ()) and out["calls"] == []
    out = _both(RaisingEventGate, FakeRuntime)
    assert out["raised"] == (RuntimeError, ("no event here",)) and out["calls"] == []
    out = _both(Gate, FakeRuntime, original_raises=OSError("device"))
    assert out["raised"] == (OSError, ("device",)) and out["stamp"] is not None


def test_bound_like_the_function_it_replaces() -> None:
    def record(self: Any, stream: Any = None) -> Any:
        return (self, stream)

    rt = FakeRuntime()
    native = wrappers.wrap_gate_record(record, rt)
    assert type(native) is wrappers.NATIVE_GATE_RECORD and patches.is_wrapped(native)
    assert native.__wrapped__ is record and native.__name__ == "record"
    cls = type("G", (Gate,), {"record": native})
    g = cls()
    assert g.record("s") == (g, "s")  # LOAD_METHOD: called unbound with the gate
    bound = getattr(g, "record")
    assert bound.__self__ is g and bound(stream="t") == (g, "t")
    assert cls.record(g) == (g, None)  # through the class, as a function
    with pytest.raises(TypeError):
        cls.record()  # no gate: the original's own TypeError
    assert STAMP in g.__dict__


class NoEventGate:
    """A gate with ``__dict__`` and no ``_event`` at all: read as None (``getattr`` with a default)."""


class RaisingFlagRuntime(FakeRuntime):
    @property  # type: ignore[misc]
    def npu_timing_wanted(self) -> bool:  # type: ignore[override]
        raise ValueError("flag")

    @npu_timing_wanted.setter
    def npu_timing_wanted(self, value: bool) -> None:
        pass


class ListLike:
    """A ``done_by`` that is not an exact list: its own ``append`` is what the rule calls."""

    def __init__(self) -> None:
        self.items: list[int] = []

    def append(self, v: int) -> None:
        self.items.append(v)

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Any:
        return iter(self.items)


def test_more_gates_and_runtimes(monkeypatch: pytest.MonkeyPatch) -> None:
    out = _both(NoEventGate, FakeRuntime)
    assert out["stamp"] == (1007, StreamPosition, True, True, 0, None)
    out = _both(DictErrorGate, FakeRuntime)
    assert out["raised"] == (RuntimeError, ("dict read failed",)) and out["calls"] == []
    out = _both(Gate, RaisingFlagRuntime)  # read inside the rule's try: tracing off, the original still runs
    assert out["failures"] == [(ValueError, ("flag",))] and out["result"] == "recorded"
    monkeypatch.setattr(attach, "npu_timing_for", lambda rt: Timing())
    out = _both(Gate, lambda: FakeRuntime(npu_timing_wanted=True), args=("s",), kwargs={"k": 2})
    assert out["calls"] == [(("s",), {"k": 2}, True)] and out["stamp"][-1] is MARK


def test_a_done_by_that_is_not_a_list_and_a_second_record() -> None:
    def odd() -> FakeRuntime:
        rt = FakeRuntime()
        rt.stream_log = StreamLog(done_by=ListLike())  # type: ignore[arg-type]
        return rt

    for make in (wrappers.gate_record_rule, _native):
        rt = odd()
        cls = type("G", (Gate,), {"record": make(lambda self, *a: "r", rt)})
        g = cls()
        assert g.record() == "r" and g.record() == "r"  # the second finds its own stamp: nothing more
        assert rt.stream_log.done_by.items == [FAR_FUTURE] and g.__dict__[STAMP][1].position == 0


@dataclass(slots=True, frozen=True)
class ShiftedPosition:
    """A position type whose ``__init__`` does more than store its arguments: it must be called, not bypassed."""

    log: Any
    position: int

    def __init__(self, log: Any, position: int) -> None:
        object.__setattr__(self, "log", log)
        object.__setattr__(self, "position", position + 1000)


def test_a_position_type_of_another_shape_is_called() -> None:
    rt = FakeRuntime()
    native = wrappers.NATIVE_GATE_RECORD(lambda self: None, rt, rt.recorder.clock, lambda self: None, STAMP,
                                         StreamLog, ShiftedPosition, MAX_EVENTS_PER_LOG, FAR_FUTURE)
    g = type("G", (Gate,), {"record": native})()
    g.record()
    assert g.__dict__[STAMP][1].position == 1000


def test_init_is_checked_and_happens_once() -> None:
    rt = FakeRuntime()
    ok = (len, rt, rt.recorder.clock, len, STAMP, StreamLog, StreamPosition, MAX_EVENTS_PER_LOG, FAR_FUTURE)
    native = wrappers.NATIVE_GATE_RECORD(*ok)
    with pytest.raises(TypeError):
        native.__init__(*ok)
    with pytest.raises(TypeError):
        wrappers.NATIVE_GATE_RECORD(*ok[:4], 5, *ok[5:])  # stamp_attr not a str
    blank = wrappers.NATIVE_GATE_RECORD.__new__(wrappers.NATIVE_GATE_RECORD)
    with pytest.raises(TypeError, match="not initialised"):
        blank(Gate())


def test_no_reference_leaks_and_collectable() -> None:
    import gc
    import sys
    import weakref

    rt = FakeRuntime()
    cls = type("G", (Gate,), {"record": _native(lambda self: None, rt)})
    gates = [cls() for _ in range(200)]
    gc.collect()
    before = (sys.getrefcount(FAR_FUTURE), sys.getrefcount(rt.stream_log))
    for g in gates:
        g.record()
    del gates, g
    gc.collect()
    after = (sys.getrefcount(FAR_FUTURE), sys.getrefcount(rt.stream_log))
    assert after[0] - before[0] == 200 and after[1] == before[1]  # the log's entries hold FAR_FUTURE; nothing else
    ref = weakref.ref(rt)
    rt.gate_class = cls  # type: ignore[attr-defined]  # a cycle through the native: rt -> class -> native -> rt
    del rt, cls
    gc.collect()
    assert ref() is None
