"""The native probes (``_probes.Take``, ``GateAfter``, ``SaveAfter``) are initialised once: a call before a whole
``__init__`` and a second ``__init__`` are refused, so their cached slot offsets never change under a call
(a failed second ``__init__`` used to leave another type's offsets in place: the next call wrote into the
wrong object's memory)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from otel_kvtrace.instrument import rewrite, wrappers
from otel_kvtrace.record.recorder import Recorder
from tests.native import require_built


class Plain:
    """A class with none of the record's fields: any ``__init__`` naming it as a record type fails."""


def _natives() -> list[tuple[str, Callable[[], Any], tuple[Any, ...]]]:
    require_built("otel_kvtrace.instrument._probes", "the rules' text")
    rec = Recorder()
    take = wrappers.make_take(rec)
    gate = wrappers.make_gate_after()
    save = rewrite.make_save_after()
    return [
        ("Take", take, (rec._pool, wrappers.TaskRecord, Plain, Plain, Plain, "x")),
        ("GateAfter", gate, (wrappers.gate_after_rule(), Plain, Plain, Plain, "x", 1, 2, 3, 4, 0, 2)),
        ("SaveAfter", save, (Plain, "a", "b", 1, 2, 0)),
    ]


@pytest.mark.parametrize("which", ["Take", "GateAfter", "SaveAfter"])
def test_a_second_init_is_refused_and_leaves_the_native_as_it_was(which: str) -> None:
    name, native, other_args = next(n for n in _natives() if n[0] == which)
    assert native is not None
    with pytest.raises(TypeError, match="initialised once"):
        native.__init__(*other_args)
    with pytest.raises(TypeError, match="initialised once"):
        native.__init__(*other_args[:1])  # refused before its arguments are even parsed


@pytest.mark.parametrize("which", ["Take", "GateAfter", "SaveAfter"])
def test_a_native_whose_init_failed_refuses_calls_and_can_be_initialised_again(which: str) -> None:
    name, native, other_args = next(n for n in _natives() if n[0] == which)
    fresh = type(native).__new__(type(native))
    with pytest.raises(TypeError, match="not initialised"):
        fresh(*([None] * {"Take": 5, "GateAfter": 5, "SaveAfter": 6}[name]))
    with pytest.raises(AttributeError):  # Plain has none of the record's fields: fails half way
        fresh.__init__(*other_args)
    with pytest.raises(TypeError, match="not initialised"):
        fresh(*([None] * {"Take": 5, "GateAfter": 5, "SaveAfter": 6}[name]))
