"""``proxies.total_bytes``: the ndarray fast path (and the native sum, ``_probes.c``) gives what the generic
rule gives, for every shape, dtype, stride and range."""

from __future__ import annotations


import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from otel_kvtrace.instrument import proxies
from otel_kvtrace.instrument.proxies import SMALL_ARRAY, total_bytes, total_bytes_rule
from tests.native import require_built


class SizesArray(np.ndarray):
    """An ndarray subclass: not the fast path's exact type, so the generic rule sums it."""


CASES = {
    "small 1-D int64": np.arange(1, 33, dtype=np.int64) * 4096,
    "large 1-D": np.full(SMALL_ARRAY + 5, 7, dtype=np.int64),
    "2-D": np.arange(12, dtype=np.int32).reshape(3, 4),
    "float": np.array([1.5, 2.5, 3.0]),
    "empty": np.zeros(0, dtype=np.int64),
    "broadcast view": np.broadcast_to(np.array([4096, 8192]), (16, 2)).ravel(),
    "subclass": (np.arange(5, dtype=np.int64) + 1).view(SizesArray),
    "list": [1, 2, 3],
    "nested list": [[1, 2], [3]],
    "strided": np.arange(40, dtype=np.int64)[::3],
    "unsigned": np.array([2**63 + 5, 7], dtype=np.uint64),
    "overflowing int64": np.array([2**62, 2**62, 2**62], dtype=np.int64),
    "bool": np.array([True, False, True]),
    "big-endian": np.arange(5, dtype=">i8"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_total_bytes_equals_the_python_sum(case: str) -> None:
    sizes = CASES[case]
    if case == "overflowing int64":  # the rule's own answer: exact up to SMALL_ARRAY items
        assert total_bytes(sizes) == total_bytes_rule(sizes) == 3 * 2**62
        return
    flat = [x for row in sizes for x in (row if isinstance(row, list) else [row])] if isinstance(sizes, list) \
        else np.asarray(sizes).ravel().tolist()
    got = total_bytes(sizes)
    assert type(got) is int and got == int(sum(flat)) == total_bytes_rule(sizes)


def test_total_bytes_of_something_unsummable_is_zero() -> None:
    assert total_bytes(object()) == 0 and total_bytes(np.array(["a"])) == 0


_DTYPES = st.sampled_from(["?", "i1", "u1", "i2", "u2", "i4", "u4", "i8", "u8", ">i4", "<i8", "f8", "f4"])


@st.composite
def _arrays(draw: st.DrawFn) -> np.ndarray:
    dtype = np.dtype(draw(_DTYPES))
    shape = draw(st.one_of(st.integers(0, SMALL_ARRAY + 20).map(lambda n: (n,)),
                           hnp.array_shapes(min_dims=0, max_dims=3, max_side=6)))
    a = draw(hnp.arrays(dtype, shape, elements=None if dtype.kind != "f" else st.floats(-1e6, 1e6)))
    if a.ndim == 1 and len(a) > 1 and draw(st.booleans()):
        a = a[:: draw(st.integers(-3, 3).filter(bool))]  # strided and reversed views
    return a


@given(_arrays())
@settings(max_examples=400, deadline=None)
def test_native_sum_equals_the_rule(sizes: np.ndarray) -> None:
    """Whatever the native sum answers is the rule's answer (it hands everything else to the rule)."""
    want = total_bytes_rule(sizes)
    got = total_bytes(sizes)
    assert type(got) is int and got == want


def test_the_native_sum_is_in_use_when_it_can_be_built() -> None:
    """So the suite cannot silently test only the Python rule: where a compiler and the Python headers exist
    the extension must have been built by ``pip install -e .`` and be what ``total_bytes`` is."""
    require_built("otel_kvtrace.instrument._probes", "the Python rule")
    assert proxies.total_bytes is not total_bytes_rule
    from otel_kvtrace.instrument import _probes  # type: ignore[attr-defined]

    assert proxies.total_bytes is _probes.total_bytes
