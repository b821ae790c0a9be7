"""Recorded tasks shared by several what-if tests."""

from __future__ import annotations

from otel_kvtrace.whatif.task import ReplayTask

U = 1000  # ns per us


def three_loads_behind_a_save() -> list[ReplayTask]:
    """One step, loads of layers 0-2 (times in us); the forward leaves layer 0's wait at 100 and layer 1's
    at 200; layer 2 waits for the save of layer 1's buffer, met at 2600."""
    return [
        ReplayTask("q", 0, 0, 0, 0, (0, 0, 0, 90 * U), recorded_start_ns=0, recorded_complete_ns=90 * U,
                   consumer_wait_start_ns=5 * U, consumer_wait_end_ns=100 * U),
        ReplayTask("q", 1, 0, 1, 0, (0, 0, 0, 100 * U), recorded_start_ns=90 * U, recorded_complete_ns=190 * U,
                   consumer_wait_start_ns=150 * U, consumer_wait_end_ns=200 * U),
        ReplayTask("q", 2, 0, 2, 0, (0, 100 * U, 0, 0), ready_save_ns=2600 * U, wait_for_save_layer=1,
                   recorded_start_ns=190 * U, recorded_complete_ns=2700 * U, consumer_wait_start_ns=250 * U,
                   consumer_wait_end_ns=2710 * U),
    ]
