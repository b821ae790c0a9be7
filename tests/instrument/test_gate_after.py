"""The gate rule after a successful gate wait: the native ``_probes.GateAfter`` does what its rule's text
(``wrappers.gate_rule``, inlined when the extension is not built; ``wrappers.gate_after_rule`` is that text as a
function) does, for generated records, gates, stamps and stream logs: the same stages, deps, dependency bits and
NPU marks (the same objects), the same stream-log bound and observed position, and the same exception (with what
the rule had written by then) when the rule raises."""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from otel_kvtrace.instrument import rewrite, wrappers
from otel_kvtrace.instrument.stream_order import FAR_FUTURE, StreamLog, StreamPosition
from otel_kvtrace.record.model import NO_TIME, NUM_DEPS, TaskRecord
from tests.instrument.test_enqueue_take import Gate, SlottedGate
from tests.instrument.native_rule_cases import HAS_DEP, INTS, SubRecord, typed
from tests.native import require_built

RULE = wrappers.gate_after_rule()
STAMP = wrappers.GATE_STAMP_ATTR


class OddDict(dict):
    """A gate ``__dict__`` that is not an exact dict: its own ``get`` is what the rule calls."""

    def get(self, key: Any, default: Any = None) -> Any:
        return super().get(key, default)


class RaisingDictGate:
    """A gate whose ``__dict__`` raises: AttributeError (the rule's "no stamp") or another error (raised)."""

    def __init__(self, exc: type[BaseException]) -> None:
        self.exc = exc

    def __getattribute__(self, name: str) -> Any:
        if name == "__dict__":
            raise object.__getattribute__(self, "exc")("no dict here")
        return object.__getattribute__(self, name)



class Mark:
    """A device-timing mark (identity compared)."""




@st.composite
def _cases(draw: st.DrawFn) -> dict[str, Any]:
    g0 = draw(st.integers(0, 1000)) + draw(st.sampled_from([0, 0, 0, 2**30 - 500, 2**60 - 500]))  # edges
    g1 = g0 + draw(st.integers(-50, 1000))  # a clock that went back too
    if draw(st.booleans()):
        g0, g1 = g0 + 2**65, g1 + 2**65  # past a C long (the clock never is, the rule does not care)
    # the record time: before g0, at g0, between, at g1, after g1, or anything
    grec = draw(st.sampled_from([g0 - 7, g0, (g0 + g1) // 2, g1, g1 + 7, None]))
    if grec is None:
        grec = draw(INTS)
    n_log = draw(st.integers(0, 6))
    return dict(
        g0=g0, g1=g1, grec=grec,
        gate=draw(st.sampled_from(["stamped", "no stamp", "stamp None", "slotted", "odd dict", "dict raises attr",
                                   "dict raises other", "list stamp", "short stamp"])),
        mark=draw(st.booleans()),
        pos=draw(st.sampled_from(["exact", "namespace"])),
        position=draw(st.integers(-2, n_log)),
        done_by=draw(st.lists(st.one_of(st.just(FAR_FUTURE), st.integers(g0 - 50, g1 + 50)), min_size=n_log,
                              max_size=n_log)),
        observed=draw(st.integers(-1, n_log)),
        record=draw(st.sampled_from(["exact", "exact", "sub"])),
        deps=draw(st.sampled_from(["list", "list", "short", "dict"])),
        t_enqueue=draw(INTS), has_dep=draw(HAS_DEP),
        stages=draw(st.sampled_from(["list", "tuple"])), prior_stages=draw(st.lists(st.integers(0, 9), max_size=6)),
        prior_marks=draw(st.integers(0, 2)),
    )


def _make(case: dict[str, Any]) -> dict[str, Any]:
    """Fresh objects for one run."""
    if case["pos"] == "exact":
        log: Any = StreamLog(done_by=list(case["done_by"]), observed=case["observed"])
        pos: Any = StreamPosition(log, case["position"])
    else:  # another type of position and log: getattr/setattr, a dict of bounds
        log = SimpleNamespace(done_by=dict(enumerate(case["done_by"])), observed=case["observed"])
        pos = SimpleNamespace(log=log, position=case["position"])
    mark = Mark() if case["mark"] else None
    stamp: Any = (case["grec"], pos, mark)
    kind = case["gate"]
    gate: Any
    if kind == "slotted":
        gate = SlottedGate()
    elif kind == "dict raises attr":
        gate = RaisingDictGate(AttributeError)
    elif kind == "dict raises other":
        gate = RaisingDictGate(LookupError)
    else:
        gate = Gate()
        if kind == "odd dict":
            gate.__dict__ = OddDict(gate.__dict__)
        if kind in ("stamped", "odd dict"):
            gate.__dict__[STAMP] = stamp
        elif kind == "stamp None":
            gate.__dict__[STAMP] = None
        elif kind == "list stamp":
            gate.__dict__[STAMP] = list(stamp)
        elif kind == "short stamp":
            gate.__dict__[STAMP] = stamp[:2]
    rec = (SubRecord if case["record"] == "sub" else TaskRecord)()
    rec.t_enqueue = case["t_enqueue"]
    rec.has_dep = case["has_dep"]
    rec.deps = {"list": [NO_TIME] * (2 * NUM_DEPS), "short": [NO_TIME] * 5, "dict": {}}[case["deps"]]
    rec.stages = list(case["prior_stages"]) if case["stages"] == "list" else tuple(case["prior_stages"])
    for i in range(case["prior_marks"]):
        rec.npu_marks.append((i, Mark()))
    return dict(rec=rec, gate=gate, log=log, pos=pos, mark=mark, stamp=gate.__dict__.get(STAMP) if kind not in (
        "slotted", "dict raises attr", "dict raises other") else None)


def _snapshot(objs: dict[str, Any]) -> dict[str, Any]:
    rec = objs["rec"]

    def tag(x: Any) -> Any:
        if x is objs["pos"]:
            return "pos"
        if x is objs["mark"] and x is not None:
            return "mark"
        return type(x).__name__

    log = objs["log"]
    return dict(stages=(type(rec.stages).__name__, list(rec.stages)),
                deps=dict(rec.deps) if isinstance(rec.deps, dict) else list(rec.deps),
                has_dep=typed(rec.has_dep), t_enqueue=rec.t_enqueue,
                npu_marks=[(d, tag(m)) for d, m in rec.npu_marks],
                done_by=dict(log.done_by) if isinstance(log.done_by, dict) else list(log.done_by),
                observed=log.observed,
                stamp_kept=objs["stamp"] is None or getattr(objs["gate"], "__dict__", {}).get(STAMP) is objs["stamp"])


def _run(fn: Any, case: dict[str, Any]) -> tuple[str, Any, dict[str, Any]]:
    objs = _make(case)
    rec = objs["rec"]
    try:
        out = fn(rec, objs["gate"], case["g0"], case["g1"], rec.stages)
    except Exception as exc:  # noqa: BLE001 - compared below, with what was written before it
        return "raised", (type(exc), str(exc)), _snapshot(objs)
    return "ok", out, _snapshot(objs)


def _native() -> Any:
    if wrappers.NATIVE_GATE is None:
        pytest.skip("the optional _probes extension is not built (test_the_native_gate_rule_is_in_use says why)")
    return wrappers.make_gate_after()


@given(_cases())
@settings(max_examples=800, deadline=None)
def test_the_native_gate_rule_does_what_its_rule_does(case: dict[str, Any]) -> None:
    assert _run(_native(), case) == _run(RULE, case)


BASE = dict(g0=100, g1=200, grec=150, gate="stamped", mark=True, pos="exact", position=1,
            done_by=[FAR_FUTURE, FAR_FUTURE, FAR_FUTURE], observed=0, record="exact", deps="list", t_enqueue=40,
            has_dep=1, stages="list", prior_stages=[7, 1, 2], prior_marks=0)
CASES = {
    "the record between g0 and g1": dict(),
    "the record before g0": dict(grec=60),
    "the record after g1": dict(grec=260),
    "the record at g0": dict(grec=100),
    "no mark": dict(mark=False),
    "no stamp": dict(gate="no stamp"),
    "a stamp None": dict(gate="stamp None"),
    "a gate without __dict__": dict(gate="slotted"),
    "a __dict__ that is not a dict": dict(gate="odd dict"),
    "a __dict__ raising AttributeError": dict(gate="dict raises attr"),
    "a bound already lower, observed later": dict(done_by=[5, 150, 9], observed=2),
    "not the exact types": dict(record="sub", pos="namespace"),
    "a stamp the C does not unpack": dict(gate="list stamp"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_native_gate_rule_on_each_branch(name: str) -> None:
    case = {**BASE, **CASES[name]}
    got, want = _run(_native(), case), _run(RULE, case)
    assert got == want and want[0] == "ok"
    snap = want[2]
    gr, gn = 2 * 2, 2 * 3  # Dep.GATE_RECORD, Dep.GATE_NPU
    assert snap["has_dep"] == ("int", 1 | 4 | 8)
    if name in ("no stamp", "a stamp None", "a gate without __dict__", "a __dict__ raising AttributeError"):
        assert snap["deps"][gr:gn + 2] == [40, 100, 40, 200] and snap["stages"][1] == [7, 1, 2, 3, 100, 200]
        assert snap["npu_marks"] == []
    elif name == "the record between g0 and g1":
        assert snap["deps"][gr:gn + 2] == [150, 150, 150, 200]
        assert snap["stages"][1] == [7, 1, 2, 2, 100, 150, 3, 150, 200]
        assert snap["npu_marks"] == [(3, "pos"), (3, "mark")] and snap["done_by"][1] == 200 and snap["observed"] == 1
    elif name == "a bound already lower, observed later":
        assert snap["done_by"] == [5, 150, 9] and snap["observed"] == 2


@pytest.mark.parametrize("kind", ["dict raises other", "short stamp"])
def test_the_native_gate_rule_raises_what_the_rule_raises(kind: str) -> None:
    """An exception inside the rule comes out of the native call unchanged, with what the rule had written by
    then written (the compiled probe's handler then turns tracing off, as with the rule's text)."""
    case = {**BASE, "gate": kind}
    got, want = _run(_native(), case), _run(RULE, case)
    assert got == want and want[0] == "raised"
    case = {**BASE, "deps": "short"}  # deps[4..7] past a 5-item list: IndexError after the first writes
    got, want = _run(_native(), case), _run(RULE, case)
    assert got == want and want[0] == "raised" and want[1][0] is IndexError
    assert want[2]["stages"][1][3:] == [2, 100, 150, 3, 150, 200]


def test_the_native_gate_rule_keeps_reference_counts() -> None:
    """Every reference the native call takes it gives back, on every branch and on its error paths: once the
    record and the log let go of what the rule put there, the objects it touched have their counts again."""
    native = _native()
    for name, extra in [*CASES.items(), ("raises", dict(gate="dict raises other")), ("short deps", dict(deps="short"))]:
        # big ints (no cached small ones), bounds above g1 (so the done_by store runs), has_dep past the inline path
        bound = 10**31 + 7
        case = {**BASE, **extra, "g0": 10**30, "g1": 10**30 + 100, "grec": 10**30 + 50, "t_enqueue": 10**31,
                "done_by": [bound] * 3, "has_dep": 2**70 + 1}
        objs = _make(case)
        rec = objs["rec"]
        g0, g1, has_dep = case["g0"], case["g1"], rec.has_dep
        watched = [x for x in (g0, g1, objs["pos"], objs["mark"], objs["stamp"], objs["gate"], rec.t_enqueue,
                               objs["log"], objs["stamp"] and objs["stamp"][0], bound, has_dep) if x is not None]
        before = [sys.getrefcount(x) for x in watched]
        stored = False
        for _ in range(50):
            try:
                native(rec, objs["gate"], g0, g1, rec.stages)
            except Exception:  # noqa: BLE001, S110 - counted below
                pass
            stored |= objs["log"].done_by[1] is g1  # the store branch ran (position 1)
            rec.stages = list(case["prior_stages"])
            rec.deps = {"list": [NO_TIME] * (2 * NUM_DEPS), "short": [NO_TIME] * 5, "dict": {}}[case["deps"]]
            rec.npu_marks.clear()
            rec.has_dep = has_dep
            objs["log"].done_by = (list(case["done_by"]) if isinstance(objs["log"].done_by, list)
                                   else dict(enumerate(case["done_by"])))
        assert [sys.getrefcount(x) for x in watched] == before, name
        assert stored or case["gate"] != "stamped" or name in ("raises", "short deps"), name


def test_the_native_gate_rule_checks_its_call() -> None:
    native = _native()
    with pytest.raises(TypeError, match="gate_after"):
        native(TaskRecord(), None, 1, 2)
    with pytest.raises(TypeError, match="not initialised"):
        wrappers.NATIVE_GATE.__new__(wrappers.NATIVE_GATE)(TaskRecord(), None, 1, 2, [])


def test_the_native_gate_rule_is_in_use_when_it_can_be_built() -> None:
    """With a compiler here, ``pip install -e .`` builds ``_probes`` and the gate stamps call its rule: a
    missing extension would silently cost the recv thread the rule's bytecode."""
    require_built("otel_kvtrace.instrument._probes", "the rule's text (the gate stamps)")
    assert wrappers.NATIVE_GATE is not None
    assert f"{rewrite.PREFIX}gate_after(" in rewrite._GATE_AFTER and "gstamp" not in rewrite._GATE_AFTER
    assert "gstamp" in rewrite._GATE_AFTER_INLINE
    assert "gate_after(rec, self, g0, g1, stages)" in wrappers._GATE_WAIT_SOURCE[True]
    assert "gstamp" in wrappers._GATE_WAIT_SOURCE[False]
