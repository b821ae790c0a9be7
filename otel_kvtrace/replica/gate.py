"""The attention-start gate, shaped like upstream's ``AttentionComputeStartGate`` (research §1.6).

A gate is created by each ``wait_for_layer_load``; the first ``record()`` (at the attention op of that
layer) captures a fake-NPU event on the current stream and wakes waiters. ``wait()`` is a condition wait
for the record, then an unbounded ``event.synchronize()`` outside the lock.
"""

from __future__ import annotations

import threading

from otel_kvtrace.replica import fake_npu


class AttentionComputeStartGate:
    """One forward layer's attention boundary; recv tasks gated on it wait for the device to reach it."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._event: fake_npu.Event | None = None

    def record(self, stream: fake_npu.Stream | None = None) -> None:
        """Record the attention-start event; only the first record takes effect."""
        event = fake_npu.Event()  # default flags: no timing, as upstream
        event.record(stream if stream is not None else fake_npu.current_stream())
        with self._condition:
            if self._event is None:
                self._event = event
                self._condition.notify_all()

    def wait(self, timeout: float = 10.0) -> bool:
        """Wait up to ``timeout`` s for the record, then block until the device reached it."""
        with self._condition:
            while self._event is None:
                if not self._condition.wait(timeout):
                    return False
            event = self._event
        event.synchronize()
        return True


_gate_lock = threading.RLock()
_gate: AttentionComputeStartGate | None = None


def reset_attention_compute_start_gate() -> AttentionComputeStartGate:
    """Install a fresh process-wide gate (called by ``start_load_kv`` and ``wait_for_layer_load``)."""
    global _gate
    with _gate_lock:
        _gate = AttentionComputeStartGate()
        return _gate


def get_attention_compute_start_gate() -> AttentionComputeStartGate:
    """The current gate, created if none exists."""
    global _gate
    with _gate_lock:
        if _gate is None:
            _gate = AttentionComputeStartGate()
        return _gate


def record_attention_compute_start() -> None:
    """Record attention start on the current gate, if any (the attention ops call this)."""
    with _gate_lock:
        gate = _gate
    if gate is not None:
        gate.record()
