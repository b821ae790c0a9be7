"""Polling for a condition another thread or process brings about (one home for the tests' wait loops)."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(predicate: Callable[[], bool], timeout_s: float = 60.0, interval_s: float = 0.001) -> bool:
    """Poll ``predicate`` every ``interval_s`` until it holds (True) or ``timeout_s`` passed (False): a generous
    bound that a loaded CI host still meets, and a result the caller asserts, so a miss fails where it is."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)
    return True
