"""Raw engine-loop stamps -> engine steps, off the hot path.

The engine loop is FIFO at every stage: the n-th ``schedule()`` call, the n-th ``execute_model``
dispatch and the n-th ``update_from_output`` belong to step n. So the hot path stores only kinds and
times, and the n-th stamp of each kind is matched here.

Output-ready time of step n: the earliest of its upper bounds, each accepted only when it lies between
the step's launch and its update entry (FIFO: the first one after the launch is this step's):

- ``device_event``: the watcher saw the output's copy-ready event complete (``ready.py``); the bracket
  width is kept as ``done_bound_ns``;
- ``device_ready``: ``get_output`` returned on an output thread (it blocks until the device is ready);
- ``engine_poll``: ``get_output`` returned on the engine thread (``AsyncOutputFuture.result()``):
  max(device ready, engine asks);
- ``engine_observed``: nothing else; the update entry.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from otel_kvtrace.asynccheck.model import DONE_DEVICE_EVENT, DONE_DEVICE_READY, DONE_ENGINE_OBSERVED, DONE_ENGINE_POLL
from otel_kvtrace.asynccheck.recorder import Stamp, StampKind

_RECENT_DONE = 16
MAX_PENDING = 16384
"""Stamps kept per kind while their step is incomplete. A process that only sees some kinds (a worker
process whose ``get_output`` runs but whose engine lives elsewhere) never completes a step; the bound
keeps that from growing memory."""


@dataclass(slots=True)
class AssembledStep:
    """One engine step in recorder clock ns (converted to epoch ns at span build)."""

    step: int
    schedule: tuple[int, int]
    launch: tuple[int, int]
    update: tuple[int, int]
    done: int
    done_precision: str
    batch_queue: bool
    queue_depth: int
    dispatch_count: int
    done_bound_ns: int = 0
    compute: list[tuple[int, int]] = field(default_factory=list)
    comm: list[tuple[int, int]] = field(default_factory=list)


@dataclass(slots=True)
class OutputReady:
    """One async output of a process without an engine loop (recorder clock ns)."""

    seq: int
    created: int
    done: int
    done_precision: str
    done_bound_ns: int = 0


@dataclass(slots=True)
class WorkerCall:
    """One ``execute_model`` / ``sample_tokens`` call of a process without an engine loop (recorder ns)."""

    seq: int
    call: str
    start: int
    end: int


WORKER_CALLS = ("execute_model", "sample_tokens")


def _bracket_mid(ready: Stamp) -> int:
    """The ready time a watcher bracket [last query false, first query true] gives: its midpoint.

    The event completed somewhere inside; the first ``query()`` true is late by the poll interval and
    the watcher's wake-up (about half the bracket on average), the midpoint is off by at most half its
    width either way (``done_bound_ns`` keeps the whole width)."""
    return ready.t - (ready.t - ready.a) // 2


class StepAssembler:
    """Matches stamps by ordinal; keeps incomplete steps until their update ends."""

    def __init__(self) -> None:
        self._q: dict[StampKind, deque[Stamp]] = {k: deque(maxlen=MAX_PENDING) for k in StampKind}
        self._device: dict[int, list[Stamp]] = {}
        self._next_step = 0
        self._recent_done: deque[int] = deque(maxlen=_RECENT_DONE)
        self._engine_seen = False
        self._next_output = 0
        self._next_call = 0

    def feed(self, stamps: Iterable[Stamp]) -> list[AssembledStep]:
        """Add stamps; return the steps completed so far, in step order."""
        for s in stamps:
            if s.kind in (StampKind.COMPUTE, StampKind.COMM):
                if s.b >= self._next_step and len(self._device) < MAX_PENDING:
                    self._device.setdefault(s.b, []).append(s)
            else:
                self._q[s.kind].append(s)
                if s.kind == StampKind.LAUNCH_BEGIN:
                    self._engine_seen = True
        out: list[AssembledStep] = []
        q = self._q
        needed = (
            StampKind.SCHED_BEGIN,
            StampKind.SCHED_END,
            StampKind.LAUNCH_BEGIN,
            StampKind.LAUNCH_END,
            StampKind.UPDATE_BEGIN,
            StampKind.UPDATE_END,
        )
        while all(q[k] for k in needed):
            out.append(self._pop_step())
        return out

    def orphan_outputs(self) -> list[OutputReady]:
        """Outputs of a process that runs no engine loop (never saw a launch): a ``MultiprocExecutor``
        worker. Its ``get_output`` runs on ``WorkerAsyncOutputCopy`` (device_ready) and its copy-ready
        events are watched (device_event); the k-th of each is the k-th output. A watched output waits
        one flush for its ``get_output``; ``get_output`` alone is emitted at once."""
        if self._engine_seen:
            return []
        ready, got = self._q[StampKind.READY], self._q[StampKind.DONE]
        out: list[OutputReady] = []
        while got:
            d = got.popleft()
            precision = DONE_DEVICE_READY if d.a else DONE_ENGINE_POLL
            if ready:
                r = ready.popleft()
                if r.t <= d.t:
                    out.append(self._output(r.b, _bracket_mid(r), DONE_DEVICE_EVENT, r.t - r.a))
                    continue
                out.append(self._output(r.b, d.t, precision if d.a else DONE_DEVICE_EVENT, max(0, d.t - r.a)))
                continue
            out.append(self._output(d.t, d.t, precision))
        return out

    def worker_calls(self) -> list[WorkerCall]:
        """The worker calls of a process without an engine loop (a ``MultiprocExecutor`` worker), in call
        order; in the engine's process (UniProc: the worker runs inside the executor) they are dropped."""
        q = self._q[StampKind.WORKER_CALL]
        if self._engine_seen:
            q.clear()
            return []
        out: list[WorkerCall] = []
        while q:
            s = q.popleft()
            out.append(WorkerCall(self._next_call, WORKER_CALLS[1 if s.b else 0], s.t, max(s.t, s.a)))
            self._next_call += 1
        return out

    def _output(self, created: int, done: int, precision: str, bound: int = 0) -> OutputReady:
        seq = self._next_output
        self._next_output += 1
        return OutputReady(seq, min(created, done), done, precision, bound)

    @property
    def pending_steps(self) -> int:
        return len(self._q[StampKind.SCHED_BEGIN])

    def _pop_step(self) -> AssembledStep:
        q = self._q
        sb, se = q[StampKind.SCHED_BEGIN].popleft(), q[StampKind.SCHED_END].popleft()
        lb, le = q[StampKind.LAUNCH_BEGIN].popleft(), q[StampKind.LAUNCH_END].popleft()
        ub, ue = q[StampKind.UPDATE_BEGIN].popleft(), q[StampKind.UPDATE_END].popleft()
        next_launch = q[StampKind.LAUNCH_BEGIN][0].t if q[StampKind.LAUNCH_BEGIN] else ub.t
        launch_end = max(le.t, self._match_sample(lb.t, min(ub.t, next_launch)))
        done, precision, bound = self._match_done(lb.t, ub.t, next_launch)
        in_flight = 1 + sum(1 for d in self._recent_done if d > lb.t)
        self._recent_done.append(done)
        step = self._next_step
        self._next_step += 1
        device = self._device.pop(step, [])
        return AssembledStep(
            step=step,
            schedule=(sb.t, se.t),
            launch=(lb.t, launch_end),
            update=(ub.t, ue.t),
            done=done,
            done_precision=precision,
            batch_queue=bool(sb.a),
            queue_depth=in_flight,
            dispatch_count=step + 1,
            done_bound_ns=bound,
            compute=[(s.t, s.a) for s in device if s.kind == StampKind.COMPUTE],
            comm=[(s.t, s.a) for s in device if s.kind == StampKind.COMM],
        )

    def _match_sample(self, launch_begin: int, before: int) -> int:
        """End of this step's ``sample_tokens`` (0 if none): the first one starting after the launch and
        before the next step's launch (a step with nothing scheduled samples nothing)."""
        begins, ends = self._q[StampKind.SAMPLE_BEGIN], self._q[StampKind.SAMPLE_END]
        while begins and ends and begins[0].t < launch_begin:
            begins.popleft()
            ends.popleft()
        if begins and ends and begins[0].t <= before:
            begins.popleft()
            return ends.popleft().t
        return 0

    def _match_done(self, launch_begin: int, update_begin: int, next_launch: int) -> tuple[int, str, int]:
        best, precision, bound = update_begin, DONE_ENGINE_OBSERVED, 0
        get_output = self._first_between(StampKind.DONE, launch_begin, update_begin, lambda s: s.t)
        if get_output is not None:
            best, precision = get_output.t, DONE_DEVICE_READY if get_output.a else DONE_ENGINE_POLL
        # registered (created) before the next step's launch: otherwise it is that step's output
        ready = self._first_between(StampKind.READY, launch_begin, min(update_begin, next_launch), lambda s: s.b)
        if ready is not None and ready.t <= best:
            best, precision, bound = _bracket_mid(ready), DONE_DEVICE_EVENT, ready.t - ready.a
        elif ready is not None and precision == DONE_ENGINE_POLL:
            precision = DONE_DEVICE_EVENT  # the engine blocked in get_output: its return is the ready time
            bound = max(0, best - ready.a)
        return best, precision, bound

    def _first_between(self, kind: StampKind, lo: int, hi: int, key: Callable[[Stamp], int]) -> Stamp | None:
        """Pop stamps of ``kind`` older than ``lo`` (no step of ours); pop and return the next if <= ``hi``."""
        q = self._q[kind]
        while q and key(q[0]) < lo:
            q.popleft()  # e.g. a warm-up call
        if q and key(q[0]) <= hi:
            return q.popleft()
        return None
