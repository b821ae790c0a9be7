"""``bench/send_wakeups.py``'s split of a sleep: the C helper reads the same clock as ``perf_counter_ns``, so
the OS wake-up past the planned end is never negative, and a GIL held by another thread shows in the
re-take part, not in the OS part."""

import shutil
import threading
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest

import send_wakeups
from otel_kvtrace.replica.backend import FakeTokenDatabase

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="the bench's helper is built with gcc")


def _db(cost_ns: int) -> FakeTokenDatabase:
    """The replica's token database over a plan of one step, two layers: layer 1 builds for ``cost_ns``."""
    return FakeTokenDatabase(SimpleNamespace(num_layers=2, meta_build=[0, cost_ns]), None)  # type: ignore[arg-type]


def test_sleep_split_by_thread_and_layer(tmp_path: Path) -> None:
    helper = send_wakeups.build_helper(tmp_path)
    samples: send_wakeups.Samples = defaultdict(list)
    spend = send_wakeups.timed_meta_build(helper, samples)
    out: list[int] = []
    for name in ("KVCacheStoreLayerSendingThread", "KVCacheStoreLayerRecvingThread"):
        t = threading.Thread(target=lambda: out.append(spend(_db(200_000), 0, 1)), name=name)
        t.start()
        t.join()
    assert out == [1, 1]  # the plan index, as the replica's own spend_meta_build returns
    assert set(samples) == {("send", 1), ("recv", 1)}
    for (os_ns, gil_ns), in samples.values():
        assert os_ns >= 0 and gil_ns >= 0
    spend(_db(200_000), 0, 0)  # a layer without a planned build records nothing
    assert sum(map(len, samples.values())) == 2


def test_gil_held_elsewhere_lands_in_the_retake(tmp_path: Path) -> None:
    """The sleeper's OS wake-up comes soon after its 20 ms sleep; the GIL comes back only when the spinning
    thread lets it go, one switch interval (50 ms here) after the sleeper asked for it. The sleep is long
    enough for the spinning thread to be running by then, and the interval longer than an OS wake-up delayed
    by a busy 2-core host (with a 1 ms sleep and the default 5 ms interval both happened, once each)."""
    import sys

    helper = send_wakeups.build_helper(tmp_path)
    samples: send_wakeups.Samples = defaultdict(list)
    spend = send_wakeups.timed_meta_build(helper, samples)
    started = threading.Event()

    def sleeper() -> None:
        started.set()
        spend(_db(20_000_000), 0, 1)  # 20 ms asleep without the GIL

    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.05)
    try:
        t = threading.Thread(target=sleeper, name="KVCacheStoreLayerSendingThread")
        t.start()
        started.wait()
        end = time.perf_counter_ns() + 150_000_000
        while time.perf_counter_ns() < end:  # pure Python: the GIL is let go only at the switch interval
            pass
        t.join()
    finally:
        sys.setswitchinterval(interval)
    ((os_ns, gil_ns),) = samples[("send", 1)]
    assert gil_ns > os_ns and gil_ns > 20_000_000  # the sleeper woke long before it could run Python again
