"""What the native-vs-rule comparisons of the recv stamps (``test_gate_after``, ``test_save_after``) share: the
record subclass whose fields go through getattr/setattr, and the ints they draw (the C has inline paths for
exact ints of up to two 30-bit digits, so the edges of that range, int subclasses and bools are drawn too)."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from otel_kvtrace.record.model import TaskRecord


class SubRecord(TaskRecord):
    """Not the exact record type: its fields go through getattr/setattr."""


class FlagInt(int):
    """An int subclass with its own ``|``: the generic ``|=`` path must call it, as the rule's text does."""

    def __or__(self, other: Any) -> FlagInt:
        return FlagInt(int(self) | int(other) | 1 << 40)


_EDGES = [2**30 - 1, 2**30, 2**60 - 1, 2**60, -(2**30), -(2**60), -(2**60) - 1]

INTS = st.one_of(st.integers(-5, 2000), st.integers(-2**70, 2**70), st.sampled_from(_EDGES))
"""Stamps and times: small, past a C long, and the inline int path's edges."""

HAS_DEP = st.one_of(st.integers(0, 31), st.integers(-2**62, 2**62), st.sampled_from(_EDGES + [True, False]),
                    st.integers(0, 31).map(FlagInt))
"""A record's dependency bits: as recorded (0..31), any int, a bool, an int subclass with its own ``|``."""


def typed(x: Any) -> tuple[str, Any]:
    """A value with its type's name, so a result of the right value and the wrong type differs."""
    return type(x).__name__, x
