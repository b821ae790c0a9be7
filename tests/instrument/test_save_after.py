"""The save wait's after-stamp: the native ``_probes.SaveAfter`` does what its rule's text (``rewrite.save_rule``,
inlined when the extension is not built; ``rewrite.save_after_rule`` is that text as a function) does, for
generated records, threads, event lists and events: the same stages, deps and dependency bits (the same
objects), and the same exception (with what the rule had written by then) when the rule raises."""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from otel_kvtrace.instrument import rewrite
from otel_kvtrace.record.model import NO_TIME, NUM_DEPS, TaskRecord
from tests.instrument.native_rule_cases import HAS_DEP, INTS, SubRecord, typed
from tests.native import require_built

RULE = rewrite.save_after_rule()



class PlainEvent:
    """An event that is not our proxy: no ``set_ns``."""


class RaisingEvent:
    """``set_ns`` raises: AttributeError (the rule's default -1) or another error (raised)."""

    def __init__(self, exc: type[BaseException]) -> None:
        self.exc = exc

    @property
    def set_ns(self) -> int:
        raise self.exc("set_ns unreadable")




@st.composite
def _cases(draw: st.DrawFn) -> dict[str, Any]:
    w0 = draw(st.integers(0, 1000)) + draw(st.sampled_from([0, 0, 0, 2**30 - 500, 2**60 - 500]))  # edges
    w1 = w0 + draw(st.integers(-50, 1000))  # a clock that went back too
    n = draw(st.integers(0, 4))
    return dict(
        w0=w0, w1=w1, n=n, index=draw(st.integers(-2, n)),
        event=draw(st.sampled_from(["proxy", "proxy", "plain", "raises attr", "raises other"])),
        set_ns=draw(st.one_of(st.sampled_from([-1, 0, w0, w1]), INTS)),
        events=draw(st.sampled_from(["list", "list", "dict", "missing"])),
        record=draw(st.sampled_from(["exact", "exact", "sub"])),
        deps=draw(st.sampled_from(["list", "list", "short", "empty", "dict"])),
        t_enqueue=draw(INTS), has_dep=draw(HAS_DEP),
        stages=draw(st.sampled_from(["list", "tuple"])), prior_stages=draw(st.lists(st.integers(0, 9), max_size=6)),
    )


def _make(case: dict[str, Any]) -> dict[str, Any]:
    def event() -> Any:
        kind = case["event"]
        if kind == "proxy":
            return SimpleNamespace(set_ns=case["set_ns"])
        if kind == "plain":
            return PlainEvent()
        return RaisingEvent(AttributeError if kind == "raises attr" else LookupError)

    events = [event() for _ in range(case["n"])]
    thread = SimpleNamespace()
    if case["events"] == "list":
        thread.layer_save_finished_events = events
    elif case["events"] == "dict":
        thread.layer_save_finished_events = dict(enumerate(events))
    rec = (SubRecord if case["record"] == "sub" else TaskRecord)()
    rec.t_enqueue = case["t_enqueue"]
    rec.has_dep = case["has_dep"]
    rec.deps = {"list": [NO_TIME] * (2 * NUM_DEPS), "short": [NO_TIME], "empty": [], "dict": {}}[case["deps"]]
    rec.stages = list(case["prior_stages"]) if case["stages"] == "list" else tuple(case["prior_stages"])
    return dict(rec=rec, thread=thread)


def _snapshot(rec: Any) -> dict[str, Any]:
    return dict(stages=(type(rec.stages).__name__, list(rec.stages)),
                deps=dict(rec.deps) if isinstance(rec.deps, dict) else list(rec.deps),
                has_dep=typed(rec.has_dep), t_enqueue=rec.t_enqueue)


def _run(fn: Any, case: dict[str, Any]) -> tuple[str, Any, dict[str, Any]]:
    objs = _make(case)
    rec = objs["rec"]
    try:
        out = fn(rec, objs["thread"], case["index"], case["w0"], case["w1"], rec.stages)
    except Exception as exc:  # noqa: BLE001 - compared below, with what was written before it
        return "raised", (type(exc), str(exc)), _snapshot(rec)
    return "ok", out, _snapshot(rec)


def _native() -> Any:
    if rewrite.NATIVE_SAVE is None:
        pytest.skip("the optional _probes extension is not built (test_the_native_save_rule_is_in_use says why)")
    return rewrite.make_save_after()


@given(_cases())
@settings(max_examples=800, deadline=None)
def test_the_native_save_rule_does_what_its_rule_does(case: dict[str, Any]) -> None:
    assert _run(_native(), case) == _run(RULE, case)


BASE = dict(w0=100, w1=200, n=3, index=1, event="proxy", set_ns=150, events="list", record="exact", deps="list",
            t_enqueue=40, has_dep=4, stages="list", prior_stages=[7, 1, 2])
CASES = {
    "the producer's set time": dict(),
    "set at 0": dict(set_ns=0),
    "no set time (-1)": dict(set_ns=-1),
    "not our proxy": dict(event="plain"),
    "set_ns raising AttributeError": dict(event="raises attr"),
    "not the exact record type": dict(record="sub"),
    "an event dict": dict(events="dict"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_native_save_rule_on_each_branch(name: str) -> None:
    case = {**BASE, **CASES[name]}
    got, want = _run(_native(), case), _run(RULE, case)
    assert got == want and want[0] == "ok"
    snap = want[2]
    assert snap["has_dep"] == ("int", 4 | 1) and snap["stages"][1] == [7, 1, 2, 0, 100, 200]
    if name in ("the producer's set time", "not the exact record type", "an event dict"):
        assert snap["deps"][:2] == [150, 150]
    elif name == "set at 0":
        assert snap["deps"][:2] == [0, 0]
    else:
        assert snap["deps"][:2] == [40, 200]


@pytest.mark.parametrize("extra", [dict(event="raises other"), dict(index=3), dict(events="missing"),
                                   dict(deps="short"), dict(deps="short", set_ns=-1)])
def test_the_native_save_rule_raises_what_the_rule_raises(extra: dict[str, Any]) -> None:
    """An exception inside the rule comes out of the native call unchanged, with what the rule had written by
    then written (the stage first; the compiled probe's handler then turns tracing off, as with the text)."""
    case = {**BASE, **extra}
    got, want = _run(_native(), case), _run(RULE, case)
    assert got == want and want[0] == "raised"
    assert want[2]["stages"][1] == [7, 1, 2, 0, 100, 200]


def test_the_native_save_rule_keeps_reference_counts() -> None:
    native = _native()
    for name, extra in [*CASES.items(), ("raises", dict(event="raises other")), ("short", dict(deps="short"))]:
        case = {**BASE, **extra, "w0": 10**30, "w1": 10**30 + 100, "t_enqueue": 10**31, "has_dep": 2**70 + 4}
        if case["set_ns"] == 150:
            case["set_ns"] = 10**30 + 50
        objs = _make(case)
        rec, thread = objs["rec"], objs["thread"]
        w0, w1, has_dep = case["w0"], case["w1"], rec.has_dep  # has_dep past the inline int path: the generic |=
        events = getattr(thread, "layer_save_finished_events", None)
        watched = [w0, w1, rec.t_enqueue, thread, events, case["set_ns"], has_dep]
        before = [sys.getrefcount(x) for x in watched]
        for _ in range(50):
            try:
                native(rec, thread, case["index"], w0, w1, rec.stages)
            except Exception:  # noqa: BLE001, S110 - counted below
                pass
            rec.stages = list(case["prior_stages"])
            rec.deps = {"list": [NO_TIME] * (2 * NUM_DEPS), "short": [NO_TIME], "dict": {}}[case["deps"]]
            rec.has_dep = has_dep
        assert [sys.getrefcount(x) for x in watched] == before, name


def test_the_native_save_rule_checks_its_call() -> None:
    native = _native()
    with pytest.raises(TypeError, match="save_after"):
        native(TaskRecord(), None, 1, 2, 3)
    with pytest.raises(TypeError, match="not initialised"):
        rewrite.NATIVE_SAVE.__new__(rewrite.NATIVE_SAVE)(TaskRecord(), None, 0, 1, 2, [])


def test_the_native_save_rule_is_in_use_when_it_can_be_built() -> None:
    """With a compiler here, ``pip install -e .`` builds ``_probes`` and the save stamps call its rule."""
    require_built("otel_kvtrace.instrument._probes", "the rule's text (the save stamps)")
    assert rewrite.NATIVE_SAVE is not None
    assert f"{rewrite.PREFIX}save_after(" in rewrite._SAVE_AFTER and "set_ns" not in rewrite._SAVE_AFTER
    assert "set_ns" in rewrite._SAVE_AFTER_INLINE
