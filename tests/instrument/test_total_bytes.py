"""``proxies.total_bytes``: the ndarray fast path gives what the generic rule gives, for every shape."""

from __future__ import annotations

import numpy as np
import pytest

from otel_kvtrace.instrument.proxies import SMALL_ARRAY, total_bytes


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
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_total_bytes_equals_the_python_sum(case: str) -> None:
    sizes = CASES[case]
    flat = [x for row in sizes for x in (row if isinstance(row, list) else [row])] if isinstance(sizes, list) \
        else np.asarray(sizes).ravel().tolist()
    got = total_bytes(sizes)
    assert type(got) is int and got == int(sum(flat))


def test_total_bytes_of_something_unsummable_is_zero() -> None:
    assert total_bytes(object()) == 0 and total_bytes(np.array(["a"])) == 0
