"""The live scheduler: a drop-in ``request_queue`` for the GVA recv thread whose ``get()`` hands out
the task the policy picks instead of the FIFO head.

Upstream's ``run()`` and ``_handle_request`` stay untouched: ``run()`` still calls
``request_queue.get()`` once per task and ``_handle_request`` still calls ``task_done()`` once, runs
every wait (save CPU event, save NPU sync, gate, slot release) and sets the per-layer load event, so
exception propagation (``_fatal_error``, ``raise_if_failed``), the lease release and shutdown are
upstream's own. What changes is only which queued task comes out:

- ``fifo``: the head, always (the state after a runtime switch back; a fresh ``fifo`` installs nothing).
- ``ready_queue``: the head when its waits are met (or cannot be checked); otherwise the lowest-seq
  task that :func:`otel_kvtrace.schedule.rules.bypass_blocker` lets pass and whose waits are all met
  now. A passed task's waits then return at once: its NPU events are known complete before any
  ``synchronize()``.

Per ``get()``: the head is probed with the lock released (a ready head goes at once); then, under the lock
and without probing, the rules are applied to the queued tasks with per-step counts kept by
``put``/``get`` (request ids read only for a task of a later step); when they let no task pass, the head
goes (it blocks in upstream's own wait), as does a head alone in the queue, unprobed; only the tasks
they let pass are probed, with the lock released.

Readiness uses non-blocking checks only (:func:`probe`). A ``put`` and a save event's ``set()`` wake
the thread at once; a known slot-release time is slept to exactly. NPU completion and gate records have
no host callback: when the head waits only on those and no other task is ready, or when no other queued
task could pass it at all, the head is handed out and blocks in upstream's own wait (FIFO behaviour, no
polling, no extra wake-up); while the head waits on a CPU signal or
a time and another queued task waits on the device, the thread re-checks with a capped backoff
(``POLL_MIN_S`` doubling to ``POLL_MAX_S``). With nothing queued it blocks like ``queue.Queue``.
So an NPU event is synchronized only by the head, the task FIFO would run anyway, and only when no
other queued task is ready.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from otel_kvtrace.schedule import rules

logger = logging.getLogger("otel_kvtrace")

POLL_MIN_S = 20e-6
POLL_MAX_S = 200e-6

READY, SIGNAL, POLL, TIME, UNKNOWN = range(5)
"""Probe results: met; waits on a CPU signal that wakes us; waits on an NPU/gate state (re-check);
waits until a known time; cannot be checked without blocking (only ever run as the head)."""

_MISSING = object()


class _Entry:
    __slots__ = ("barrier", "final", "item", "layer", "requests", "src", "step")

    def __init__(self, item: Any, step: int, final_layer_id: int) -> None:
        self.item = item
        self.step = step
        layer = getattr(item, "layer_id", None)
        self.barrier = layer is None
        self.layer = layer if layer is not None else -1
        src = getattr(item, "wait_for_save_layer", None)
        self.src = src if src is not None else -1
        self.final = layer == final_layer_id
        self.requests: frozenset[str] | None | object = _MISSING

    def request_ids(self) -> frozenset[str] | None:
        """Request ids of the task (from its transfer tasks), read only when a step boundary is crossed."""
        if self.requests is _MISSING:
            self.requests = _request_ids(self.item)
        return self.requests  # type: ignore[return-value]


def _request_ids(item: Any) -> frozenset[str] | None:
    out: set[str] = set()
    try:
        for task in item.transfer_tasks:
            shared = getattr(task, "shared_block_data", None)
            if shared is not None and getattr(shared, "req_ids", None) is not None:
                out.update(str(r) for r in shared.req_ids)
                continue
            for rng in task.block_ranges:
                out.add(str(rng.request.req_id))
    except Exception:
        return None  # unknown: treated as shared (never passed across steps)
    return frozenset(out)


def probe(thread: Any, item: Any, now_ns: int) -> tuple[int, int]:
    """Non-blocking: are ``item``'s waits on ``thread`` met? ``(state, wake_ns)``; never synchronizes."""
    src = getattr(item, "wait_for_save_layer", None)
    if src is not None:
        if not thread.layer_save_finished_events[src].is_set():
            return SIGNAL, 0
        sync = getattr(thread, "sync_save_events", None)
        if sync is not None and not sync[src].query():
            return POLL, 0
    gate = getattr(item, "attention_start_gate", None)
    if gate is not None:
        event = getattr(gate, "_event", _MISSING)  # the gate's recorded state (None until record())
        if event is _MISSING:
            return UNKNOWN, 0
        if event is None or not event.query():
            return POLL, 0
    waiter = getattr(thread, "external_slot_release_waiter", None)
    if waiter is not None:
        release = getattr(waiter, "kvtrace_release_time", None)
        if release is None:
            return UNKNOWN, 0
        t = release(item.layer_id)
        if t > now_ns:
            return TIME, t
    return READY, 0


def unreadable_waiter(thread: Any) -> str | None:
    """Why ``thread``'s external slot-release waiter makes every task's readiness unknown, or None.

    Upstream main's waiter (``AscendMultiConnector`` with Mooncake layerwise or SFA-PD) is a plain
    blocking ``Callable[[int], None]``: it returns once a sibling connector's send freed the slot, and no
    release time can be read before calling it. A waiter that exposes ``kvtrace_release_time(layer_id)``
    (ns, ``perf_counter_ns``) is checked without blocking; any other one keeps the thread FIFO."""
    waiter = getattr(thread, "external_slot_release_waiter", None)
    if waiter is None or callable(getattr(waiter, "kvtrace_release_time", None)):
        return None
    return (f"its external slot release waiter ({type(waiter).__name__}) gives no release time without "
            "blocking")


class SchedulingQueue(queue.Queue):
    """``queue.Queue`` whose ``get()`` returns the policy's pick (see the module docstring)."""

    def __init__(self, thread: Any, policy: str, on_change: Any = None) -> None:
        super().__init__()
        self.on_change = on_change
        """Called (no arguments) after the policy changed: a switch, or a fallback to fifo."""
        self.thread = thread
        self.policy = policy
        self.final_layer_id = getattr(thread, "final_layer_id", -1)
        self.bypassed = 0
        """Tasks handed out before an unready head (a counter; read by tests and benches)."""
        self.blocked_by: dict[str, int] = dict.fromkeys(rules.RULES, 0)
        """Per rule, how often it kept a candidate behind a waiting head."""
        self._step = 0
        self._last_layer = 1 << 30
        self._signals = 0  # puts and save signals so far (a signal during an unlocked probe is not lost)
        self._handed: tuple[Any, int] = (None, -1)  # the item get() handed out last, and its step
        self._waiter_seen: Any = None  # the slot waiter last found readable (checked again only if replaced)
        self._unserved: dict[int, int] = {}  # per step: its queued tasks (kept by put and pop, not recounted)

    def set_policy(self, policy: str) -> None:
        """Runtime switch; ``fifo`` drains what is queued in FIFO order from the next ``get()`` on."""
        with self.mutex:
            self.policy = policy
            self._signals += 1
            self.not_empty.notify()
        if self.on_change is not None:
            self.on_change()

    def wake(self) -> None:
        """A producer signal (a save event set): re-check the queued tasks now."""
        with self.mutex:
            self._signals += 1
            self.not_empty.notify()

    # queue.Queue storage hooks -----------------------------------------------------------------------
    def _init(self, maxsize: int) -> None:
        self.queue: list[_Entry] = []  # type: ignore[assignment]

    def _qsize(self) -> int:
        return len(self.queue)

    def _put(self, item: Any) -> None:
        layer = getattr(item, "layer_id", None)
        if layer is not None:
            if layer <= self._last_layer:
                self._step += 1  # layers of one step are enqueued in increasing order
            self._last_layer = layer
        self.queue.append(_Entry(item, self._step, self.final_layer_id))
        self._unserved[self._step] = self._unserved.get(self._step, 0) + 1
        self._signals += 1

    def _get(self) -> Any:  # only reached through Queue.get_nowait-style callers; FIFO then
        return self._take(0).item

    def _take(self, index: int) -> _Entry:
        entry = self.queue.pop(index)
        left = self._unserved[entry.step] - 1
        if left:
            self._unserved[entry.step] = left
        else:
            del self._unserved[entry.step]
        return entry

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        """``queue.Queue.get``: non-blocking with tasks queued returns the pick, else the head (FIFO)."""
        if block and timeout is not None and timeout < 0:
            raise ValueError("'timeout' must be a non-negative number")
        deadline = None if timeout is None else time.monotonic() + timeout
        backoff = POLL_MIN_S
        with self.not_empty:
            while True:
                if self.queue:
                    pick, wait_s, seen = self._decide()
                    if pick < 0 and not block and self.queue:
                        pick = 0  # queue.Queue hands out what is queued: the head
                    if pick >= 0:
                        return self._pop(pick)
                    if seen != self._signals:
                        continue  # a put or a save signal came while probing: decide again
                else:
                    wait_s = None
                if not block:
                    raise queue.Empty
                if wait_s is not None and wait_s <= 0:  # poll with backoff
                    wait_s, backoff = backoff, min(backoff * 2, POLL_MAX_S)
                else:
                    backoff = POLL_MIN_S
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise queue.Empty
                    wait_s = left if wait_s is None else min(wait_s, left)
                self.not_empty.wait(wait_s)

    def claim_gate_group(self, head: Any) -> list[Any]:
        """``gate_group``: the queued tasks that join ``head``'s backend call (:func:`rules.gate_batch`), in
        FIFO order; [] under any other policy. Called by the recv thread that got ``head``, after its gate
        opened. The members stay queued, so ``get()`` still hands each one out (FIFO) for its own
        ``task_done`` and load event; the thread only leaves out the copy it already made."""
        layer = getattr(head, "layer_id", None)
        if self.policy != "gate_group" or layer is None or layer == self.final_layer_id:
            return []
        gate = getattr(head, "attention_start_gate", None)
        if gate is None:
            return []
        with self.mutex:
            handed, step = self._handed
            if handed is not head:
                return []
            entries = self.queue
            queued = ((e.step, getattr(e.item, "attention_start_gate", None), e.final or e.barrier, e.src)
                      for e in entries)
            k = rules.gate_batch(step, gate, layer, queued)
            return [e.item for e in entries[:k]]

    def try_get(self) -> Any:
        """What a blocking ``get()`` would hand out right now, without waiting; ``queue.Empty`` when it
        would wait (no task may go yet). Deterministic: the rule tests' entry point."""
        with self.not_empty:
            while self.queue:
                pick, _, seen = self._decide()
                if pick >= 0:
                    return self._pop(pick)
                if seen == self._signals:
                    break
            raise queue.Empty

    def _pop(self, index: int) -> Any:
        entry = self._take(index)
        self._handed = (entry.item, entry.step)
        if self.maxsize > 0:  # unbounded (the recv threads' queue): no put ever waits on not_full
            self.not_full.notify()
        return entry.item

    def _decide(self) -> tuple[int, float | None, int]:
        """Called with the lock held. The head's probe with the lock released (a ready head goes), then under
        the lock the rule pass over the queue (no probe, no allocation but the short candidate list); when
        no queued task could pass the head by the rules, the head goes at once. Otherwise the candidates
        are probed with the lock released (producers' ``put`` and save ``set()`` never wait on a probe)
        and the pick is re-checked under the lock. ``(index, wait, signals seen)``."""
        seen = self._signals
        head = self.queue[0]
        if self.policy != "ready_queue" or head.barrier:
            return 0, None, seen
        if (getattr(self.thread, "external_slot_release_waiter", None) is not self._waiter_seen
                and not self._waiter_readable()):
            return 0, None, seen
        if len(self.queue) == 1:
            return 0, None, seen  # alone, the head goes whatever its state: no probe
        # the fast path: a head whose waits are met (or cannot be checked) goes, no rule pass. Probed with
        # the lock released (an NPU ``query()`` is a driver call): a producer's put or save set never
        # waits on it. Handing out the head is always allowed, so a stale answer can only cost a pass.
        failed = None
        mutex = self.mutex
        mutex.release()  # released and taken again inline (no context manager: two frames per decision)
        try:
            state, wake = probe(self.thread, head.item, time.perf_counter_ns())
        except Exception as exc:
            state, wake, failed = -1, 0, exc
        finally:
            mutex.acquire()
        if failed is not None and self.policy == "ready_queue":  # not a policy switched to meanwhile
            self._fallback(f"scheduler error: {type(failed).__name__}: {failed}")  # off, never the thread
        if not self.queue or self.queue[0] is not head:
            return -1, 0.0, seen - 1  # taken or changed meanwhile: decide again
        if state in (READY, UNKNOWN) or self.policy != "ready_queue":
            return 0, None, seen
        try:
            cands = self._passable()
        except Exception as exc:  # a scheduler failure turns the scheduler off, never the thread
            self._fallback(f"scheduler error: {type(exc).__name__}: {exc}")
            return 0, None, seen
        if cands is None:
            return 0, None, seen  # nothing could pass: the head blocks in its own wait, as upstream
        mutex.release()
        try:
            pick, wait_s, picked = self._choose((state, wake), cands)
        finally:
            mutex.acquire()
        if pick > 0:
            if self.policy != "ready_queue" or pick >= len(self.queue) or self.queue[pick] is not picked:
                return -1 if self.policy == "ready_queue" else 0, 0.0, seen - 1  # changed meanwhile: decide again
            self.bypassed += 1
        return pick, wait_s, seen

    def _passable(self) -> list[tuple[int, _Entry, str | None]] | None:
        """Under the lock: every queued task behind the head up to a barrier, in order, with the rule
        (:func:`rules.bypass_blocker`, :func:`rules.request_blocks`) that keeps it behind the head, or
        None. Returns None (and counts the rules) when no task may pass: nothing to probe."""
        entries = self.queue
        head = entries[0]
        unserved = self._unserved
        # the first queued layer of the step being scanned (the head's step: the head's). Steps only grow
        # along the queue (put numbers them in enqueue order; a pop keeps the order), so one step's tasks are
        # contiguous and a pair of scalars is the per-step map: no dict per decision
        step, first = head.step, head.layer
        earlier: dict[int, set[str] | None] | None = None  # per earlier step: its tasks' request ids (lazily)
        folded = 0  # entries[:folded] are in ``earlier`` (request ids read only for a cross-step candidate)
        out: list[tuple[int, _Entry, str | None]] = []
        free = False
        for j in range(1, len(entries)):
            e = entries[j]
            blocker = rules.bypass_blocker(
                ready=True, is_final=e.final, unserved_in_step=unserved[e.step], need=e.src,
                first_unfinished=first if e.step == step else 1 << 30, barrier=e.barrier)
            if blocker == rules.BARRIER:
                break
            if e.step != step:
                step, first = e.step, e.layer
            if blocker is None and e.step != head.step:
                if earlier is None:
                    earlier = {}
                while folded < j:
                    _add_requests(earlier, entries[folded])
                    folded += 1
                ids = e.request_ids()
                for s, reqs in earlier.items():
                    if rules.request_blocks(e.step, ids, s, reqs):
                        blocker = rules.SAME_REQUEST
                        break
            out.append((j, e, blocker))
            free = free or blocker is None
        if free:
            return out
        for _, _, blocker in out:
            self.blocked_by[blocker] += 1  # type: ignore[index]
        return None

    def _waiter_readable(self) -> bool:
        """A waiter wired after :func:`attach` (see :func:`unreadable_waiter`): FIFO from then on, said once."""
        reason = unreadable_waiter(self.thread)
        if reason is None:
            self._waiter_seen = getattr(self.thread, "external_slot_release_waiter", None)
            return True
        self._fallback(reason)
        return False

    def _fallback(self, reason: str) -> None:
        logger.warning("otel-kvtrace: %s recv scheduler %s back to fifo: %s", type(self.thread).__name__,
                       self.policy, reason)
        self.policy = "fifo"
        if self.on_change is not None:
            self.on_change()

    # the decision ----------------------------------------------------------------------------------
    def _choose(self, head_probe: tuple[int, int], cands: list[tuple[int, _Entry, str | None]]
                ) -> tuple[int, float | None, _Entry | None]:
        """Probe the candidates the rules let pass, in order; the first ready goes. ``head_probe``: the head's
        probe of this decision (not repeated: a head that became ready since costs at most one pass, which
        the rules allow, and its producer's signal makes ``get()`` decide again). ``(index, -, entry)`` to
        hand out (entry: a candidate's, None for the head), or ``(-1, wait, None)``: wait None = until a signal,
        0 = poll, >0 s."""
        try:
            return self._choose_ready(head_probe, cands)
        except Exception as exc:  # a scheduler failure turns the scheduler off, never the thread
            self._fallback(f"scheduler error: {type(exc).__name__}: {exc}")
            return 0, None, None

    def _choose_ready(self, head_probe: tuple[int, int], cands: list[tuple[int, _Entry, str | None]]
                      ) -> tuple[int, float | None, _Entry | None]:
        head_state = head_probe[0]
        now = time.perf_counter_ns()
        waits = [head_probe]
        blocked = self.blocked_by
        thread = self.thread
        for j, e, blocker in cands:
            if blocker is not None:
                blocked[blocker] += 1
                continue
            state, wake = probe(thread, e.item, now)
            if state == READY:
                return j, None, e
            if state != UNKNOWN:
                waits.append((state, wake))
            blocked[rules.DEPENDENCY] += 1
        if head_state == POLL or len(waits) == 1:
            # nothing else is ready, and either the head waits only on device progress (an NPU event, a
            # gate) or no other queued task could pass it: block in the head's own wait as upstream does
            # (no polling, no extra wake-up hop)
            return 0, None, None
        return -1, _wait_for(waits, now), None


def _add_requests(earlier: dict[int, set[str] | None], entry: _Entry) -> None:
    """Fold ``entry``'s request ids into its step's union (None: unknown, shared with everything)."""
    if entry.barrier:
        return
    ids = entry.request_ids()
    if entry.step not in earlier:
        earlier[entry.step] = set() if ids is not None else None
    union = earlier[entry.step]
    if union is None or ids is None:
        earlier[entry.step] = None
    else:
        union |= ids


def _wait_for(waits: list[tuple[int, int]], now_ns: int) -> float | None:
    """How long to sleep: None (until a put or save signal), 0 (poll an NPU/gate state), or seconds."""
    best: float | None = None
    for state, wake in waits:
        if state == POLL:
            return 0.0
        if state == TIME:
            s = max(1e-6, (wake - now_ns) / 1e9)
            best = s if best is None else min(best, s)
    return best


def hook_save_signals(q: SchedulingQueue, events: list[threading.Event]) -> None:
    """Make each save event's ``set()`` also wake the scheduler (the producer's own signal)."""
    for ev in events:
        original = ev.set

        def set_and_wake(_original: Any = original) -> None:
            _original()
            q.wake()

        ev.set = set_and_wake  # type: ignore[method-assign]
