"""The enqueue's record take: the native ``_probes.Take`` does what its rule's text (``wrappers.take_rule``,
inlined when the extension is not built) does, for generated queue/worker states, tasks and gates: the same
record fields (the same objects), the same state and worker changes, the same gate id on the gate, the same
pool use, and the same exception when the rule raises."""

from __future__ import annotations

import copy
import dataclasses
from collections import deque
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from otel_kvtrace.instrument import wrappers
from otel_kvtrace.instrument.attach import GATE_ID_ATTR
from otel_kvtrace.instrument.state import QueueState, WorkerState
from otel_kvtrace.record.model import QueueInfo, TaskRecord
from tests.native import require_built

INFO = QueueInfo(run_id="r", path="gva", thread_name="t", pid=1, num_layers=8)


def _rule() -> Any:
    """The rule's text as a function (the names the compiled enqueue gets from its closure as parameters)."""
    body = wrappers.indent_rule(wrappers.take_rule("", "layer_id", "save_layer", "tasks", "gate"), 4)
    src = ("def take(st, layer_id, save_layer, tasks, gate, pool, new_record, IndexError, AttributeError,"
           " len, list, setattr):\n" + body + "\n    return rec\n")
    ns: dict[str, Any] = {}
    exec(compile(src, "take_rule", "exec"), ns)  # noqa: S102 - our own rule's text
    return ns["take"]


RULE = _rule()


class Gate:
    """A gate with ``__dict__`` (upstream's ``AttentionComputeStartGate`` shape)."""

    def __init__(self) -> None:
        self._event = None


class SlottedGate:
    __slots__ = ("_event",)


class StrictTasks(list):
    """A task list whose truth raises: the rule's exception must come out of the native take as it is."""

    def __bool__(self) -> bool:
        raise LookupError("no truth")


@st.composite
def _cases(draw: st.DrawFn) -> dict[str, Any]:
    ints = st.one_of(st.integers(-3, 300), st.integers(-2**64, 2**64))  # small ints, past a C long too
    worker = dict(step=draw(ints), driven=draw(st.booleans()), forward_layer=draw(st.sampled_from([-2**70, -2, -1, 0, 3, 9, 2**70])),
                  seen_layers=draw(st.sets(st.integers(0, 9), max_size=5)))
    state = dict(enqueued=draw(ints), dequeued=draw(ints), completed=draw(ints), gates_seen=draw(st.integers(0, 5)),
                 final_layer_id=draw(st.one_of(st.integers(-1, 9), st.just(2**65))))
    gate_kind = draw(st.sampled_from(["none", "new", "has id", "id None", "slotted"]))
    tasks = draw(st.sampled_from(["empty", "one", "two", "none", "tuple"]))
    return dict(worker=worker, state=state, layer=draw(st.integers(0, 9)),
                save=draw(st.one_of(st.none(), st.integers(0, 9))), gate=gate_kind, tasks=tasks,
                pooled=draw(st.booleans()), gid=draw(st.integers(0, 40)))


def _make(case: dict[str, Any]) -> tuple[Any, ...]:
    """Fresh objects for one run: (st, layer_id, save_layer, tasks, gate, pool)."""
    worker = WorkerState(**{**case["worker"], "seen_layers": set(case["worker"]["seen_layers"])})
    state = QueueState(info=INFO, worker=worker, **case["state"])
    elems = [object(), object()]
    tasks = {"empty": [], "one": elems[:1], "two": elems, "none": None, "tuple": tuple(elems)}[case["tasks"]]
    gate: Any = None
    if case["gate"] != "none":
        gate = SlottedGate() if case["gate"] == "slotted" else Gate()
        if case["gate"] == "has id":
            setattr(gate, GATE_ID_ATTR, case["gid"])
        elif case["gate"] == "id None":
            setattr(gate, GATE_ID_ATTR, None)
    pool: deque[TaskRecord] = deque([TaskRecord()] if case["pooled"] else [])
    return state, case["layer"], case["save"], tasks, gate, pool


def _snapshot(state: QueueState, gate: Any, pool: deque, rec: TaskRecord, tasks: Any) -> dict[str, Any]:
    fields = {f.name: getattr(rec, f.name) for f in dataclasses.fields(rec)}
    fields["queue"] = fields["queue"] is INFO
    # the one task as is (the same object), several as a new list of the same objects
    t = fields["transfer_tasks"]

    def pos(x: Any) -> int:
        return next(i for i, e in enumerate(tasks) if e is x)

    fields["transfer_tasks"] = (type(t).__name__, t is tasks,
                                [pos(x) for x in t] if isinstance(t, list) else (pos(t) if t is not None else None))
    st_fields = {f.name: getattr(state, f.name) for f in dataclasses.fields(state) if f.name not in ("worker", "info")}
    return dict(rec=fields, state=st_fields, worker=dataclasses.asdict(state.worker), pool=len(pool),
                rec_from_pool=None, gate=getattr(gate, "__dict__", {}).get(GATE_ID_ATTR, "absent"),
                types=(type(fields["final_layer"]), type(rec.seq)))


def _run(take: Any, case: dict[str, Any]) -> tuple[str, Any]:
    state, layer, save, tasks, gate, pool = _make(case)
    pooled = list(pool)
    try:
        if take is RULE:
            rec = RULE(state, layer, save, tasks, gate, pool, TaskRecord, IndexError, AttributeError, len, list,
                       setattr)
        else:
            rec = take(pool)(state, layer, save, tasks, gate)
    except Exception as exc:  # noqa: BLE001 - compared below
        return "raised", (type(exc), str(exc))
    snap = _snapshot(state, gate, pool, rec, tasks)
    snap["rec_from_pool"] = bool(pooled) and rec is pooled[0]
    return "ok", snap


def _native() -> Any:
    if wrappers.NATIVE_TAKE is None:
        pytest.skip("the optional _probes extension is not built (test_the_native_take_is_in_use says why)")
    return lambda pool: wrappers.NATIVE_TAKE(pool, TaskRecord, TaskRecord, QueueState, WorkerState, GATE_ID_ATTR)


@given(_cases())
@settings(max_examples=500, deadline=None)
def test_the_native_take_does_what_its_rule_does(case: dict[str, Any]) -> None:
    assert _run(_native(), case) == _run(RULE, case)


CASES = {
    "a repeated layer starts a step": dict(worker=dict(step=4, driven=False, forward_layer=-1, seen_layers={1, 3}),
                                           layer=3),
    "a new gate, forward layer known": dict(gate="new", worker=dict(step=0, driven=True, forward_layer=6,
                                                                    seen_layers=set())),
    "a new gate, no forward layer": dict(gate="new"),
    "a gate with its id": dict(gate="has id", gid=17),
    "a slotted gate": dict(gate="slotted"),
    "several tasks": dict(tasks="two"),
    "the pool is empty": dict(pooled=False),
    "counters past the small ints": dict(state=dict(enqueued=100000, dequeued=3, completed=99999, gates_seen=1000,
                                                    final_layer_id=7), layer=7),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_native_take_on_each_branch(name: str) -> None:
    base = dict(worker=dict(step=2, driven=False, forward_layer=-1, seen_layers={0}),
                state=dict(enqueued=5, dequeued=2, completed=1, gates_seen=3, final_layer_id=7), layer=2, save=1,
                gate="none", tasks="one", pooled=True, gid=0)
    case = {**base, **CASES[name]}
    got, want = _run(_native(), case), _run(RULE, case)
    assert got == want and want[0] == "ok"
    if name == "a repeated layer starts a step":
        assert want[1]["worker"]["step"] == 5 and want[1]["worker"]["seen_layers"] == {3}
    if name.startswith("a new gate"):
        assert want[1]["gate"] == want[1]["rec"]["gate_id"] == (6 if "known" in name else 3)
        assert want[1]["state"]["gates_seen"] == 4


def test_the_native_take_raises_what_the_rule_raises() -> None:
    """An exception inside the rule (here: the task list's truth) comes out of the native take unchanged; the
    compiled enqueue's handler then turns tracing off, as with the rule's text."""
    native = _native()
    state, layer, save, _tasks, gate, pool = _make(dict(
        worker=dict(step=0, driven=True, forward_layer=-1, seen_layers=set()),
        state=dict(enqueued=0, dequeued=0, completed=0, gates_seen=0, final_layer_id=7), layer=1, save=None,
        gate="none", tasks="one", pooled=True, gid=0))
    ref_state = copy.deepcopy(state)
    with pytest.raises(LookupError, match="no truth"):
        native(pool)(state, layer, save, StrictTasks([1]), gate)
    with pytest.raises(LookupError, match="no truth"):
        RULE(ref_state, layer, save, StrictTasks([1]), gate, deque([TaskRecord()]), TaskRecord, IndexError,
             AttributeError, len, list, setattr)


def test_the_native_take_is_in_use_when_it_can_be_built() -> None:
    """With a compiler here, ``pip install -e .`` builds ``_probes`` and the enqueue uses its take: a missing
    extension would silently cost the forward thread the rule's bytecode."""
    require_built("otel_kvtrace.instrument._probes", "the rule's text (the enqueue's take)")
    assert wrappers.NATIVE_TAKE is not None
    assert "__kvtrace_take(" in wrappers.enqueue_rule("__kvtrace_", "SELF", "DATA")
    assert "seen_layers" not in wrappers.enqueue_rule("__kvtrace_", "SELF", "DATA")
    assert "seen_layers" in wrappers.enqueue_rule("__kvtrace_", "SELF", "DATA", native=False)
