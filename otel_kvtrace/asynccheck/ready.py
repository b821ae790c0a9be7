"""When does a step's output really become ready? A watcher that only ``query()``s the copy-ready event.

vLLM's async outputs (``AsyncGPUModelRunnerOutput``, MRV2 ``AsyncOutput``, the pooling variants) record
an event on the output-copy stream in ``__init__``; ``get_output()`` synchronizes it. With
``UniProcExecutor`` that ``get_output()`` runs lazily on the engine thread inside
``AsyncOutputFuture.result()``, so its return is max(device ready, engine asks): an upper bound, not the
ready time. The engine thread only appends ``(event, now)`` to a deque (lock-free under the GIL); this
daemon thread polls the oldest pending event with ``query()`` (never ``synchronize()``: that could
reorder nothing but would pin the driver lock) and stamps ``READY`` with the bracket
``[last query false, first query true]``; the worker call that created the output queries once more as
it returns (``poke``), which narrows the bracket of an event that completes just after ``__init__``
without waiting for the watcher's wake-up. The bracket is the precision: with host threads holding the
GIL it widens up to ``sys.getswitchinterval()``, and the exporter carries its width on the span.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
import time
from collections import deque
from typing import Any

from otel_kvtrace.asynccheck.recorder import StampBuffer, StampKind

logger = logging.getLogger("otel_kvtrace")
_sleep = time.sleep

EVENT_ATTRS = ("async_copy_ready_event", "copy_event")
"""Copy-ready event attribute of vLLM's async output classes (V1 runner, MRV2)."""
POLL_S = 0.0001
MAX_POLL_S = 0.0003
"""Polls start ``POLL_S`` apart after an output completes and double while nothing completes, up to
``MAX_POLL_S``: a bracket stays within ~0.3 ms while the watcher wakes at most ~3k times per second
instead of 10k (each wake-up takes the GIL from the engine thread)."""
IDLE_S = 0.002
ACTIVE_NS = 50_000_000
"""For this long after the last output the watcher polls with the backoff above even with nothing
pending; after it, every ``IDLE_S``."""
_READY = int(StampKind.READY)
MAX_PENDING = 64
"""Outputs in flight are at most the batch-queue depth; more means the watcher fell behind: the output
is not watched and counted (``StampBuffer.outputs_dropped``; ``kvtrace async check`` warns)."""


class ReadyWatcher:
    """Daemon thread ``kvtrace-async-ready``: READY stamps for registered copy-ready events."""

    def __init__(self, buffer: StampBuffer) -> None:
        self.buffer = buffer
        self.pending: deque[tuple[Any, int]] = deque()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fork_hook = False
        self.failed = False
        self.seen: tuple[Any, int, bool] | None = None
        """The last ``poke()``: (event, when, complete then); tightens the watcher's bracket of that event."""

    def register(self, output: Any) -> None:
        """Hot path (engine or worker thread, in the output's ``__init__``): hand the event over."""
        for name in EVENT_ATTRS:
            event = getattr(output, name, None)
            if event is not None:
                if self.failed:
                    return
                if len(self.pending) >= MAX_PENDING:
                    self.buffer.output_dropped()
                    return
                clock = self.buffer.clock
                registered = clock()
                if not self.pending and event.query():
                    # nothing older outstanding and already complete (recorded on an idle stream: a launch
                    # that waited for the device): ready by now, no watcher wake-up latency in the bracket
                    self.buffer.put(_READY, clock(), registered, registered)
                    return
                self.pending.append((event, registered))
                if self._thread is None:  # once per process: processes that make no outputs stay idle
                    self.start()
                return

    def poke(self) -> None:
        """Hot path (the thread that created the output, as its launch call returns): one ``query()`` of the
        oldest pending event. An event that completes just after ``register()`` (the short copy behind a
        launch that waited for the device) is then bracketed by this call, not by the watcher's next
        wake-up, which is up to ``MAX_POLL_S`` plus the OS's wake-up latency later (0.1-0.3 ms under load).
        Only observes: the watcher still stamps, so each output gets exactly one READY."""
        if self.failed:
            return
        try:
            event = self.pending[0][0]
        except IndexError:  # nothing pending, or the watcher took it meanwhile
            return
        clock = self.buffer.clock
        before = clock()
        try:
            done = event.query()
        except Exception:  # noqa: BLE001 - a broken event disables the watcher, never the host
            self.failed = True  # the watcher thread sees it and ends; register() stops handing events over
            self.pending.clear()
            logger.exception("otel-kvtrace: output-ready watcher disabled")
            return
        self.seen = (event, clock() if done else before, done)  # true by then / still false then

    def start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            if self._thread is None and hasattr(os, "register_at_fork") and not self._fork_hook:
                self._fork_hook = True
                ref = weakref.WeakMethod(self.after_fork)
                os.register_at_fork(after_in_child=lambda: (m := ref()) is not None and m())
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._run, name="kvtrace-async-ready", daemon=True)
            self._thread.start()

    def after_fork(self) -> None:
        """In a forked child: the parent's events are not ours; the next output starts a fresh thread."""
        self.pending.clear()
        self._thread = None

    def stop(self, timeout_s: float = 1.0) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        clock = self.buffer.clock
        put = self.buffer.put
        pending = self.pending
        ready_code = _READY
        last_false = 0
        last_seen = 0
        delay = POLL_S
        while not self._stop.is_set() and not self.failed:
            if not pending:
                if clock() - last_seen < ACTIVE_NS:
                    _sleep(delay)
                    delay = min(2 * delay, MAX_POLL_S)
                else:
                    _sleep(IDLE_S)
                continue
            try:
                event, registered = pending[0]
            except IndexError:  # poke() failed and cleared it meanwhile
                continue
            before = clock()  # a false answer holds at least until the query began (poke's convention)
            try:
                done = event.query()
            except Exception:  # noqa: BLE001 - a broken event disables the watcher, never the host
                logger.exception("otel-kvtrace: output-ready watcher disabled")
                self.failed = True
                pending.clear()
                return
            now = clock()
            last_seen = now
            if done:
                last_false = max(last_false, registered)
                seen = self.seen
                if seen is not None and seen[0] is event:  # the creating thread's own query since
                    if seen[2]:
                        now = min(now, seen[1])
                    elif seen[1] < now:
                        last_false = max(last_false, seen[1])
                # a false stamp taken after another thread's true one would invert the bracket
                put(ready_code, now, min(last_false, now), registered)
                if pending:  # (poke() failed and cleared it meanwhile)
                    pending.popleft()  # after the stamp: register() stamps at once only when nothing is older
                delay = POLL_S
                continue  # one in-order copy stream: the next event is ready no earlier than this one's bound
            last_false = before
            _sleep(delay)
            delay = min(2 * delay, MAX_POLL_S)
