"""Threads that wake behind the recv thread's run: the forward after a load event, the send thread after a
save's copy and after its own metadata build (docs/whatif.md, "Replay model": "Forward wake-up behind the
recv thread (GIL)", "The send thread's copy behind the recv thread (GIL)" and "The send thread's build
behind the recv thread's build"). ``Coupling`` sizes the three from a queue's FIFO replay and
``replay_policy`` applies them to a policy's replay (``replay_run(gil_lag=True)``).

The forward. When the recv thread sets a load event, the forward blocked on it wakes, but it runs only once it holds
the GIL, and the recv thread keeps the GIL while it runs Python without blocking: until its next blocking
call (a dependency wait that blocks, a sleep of the copy or of the metadata build, ``get()`` on an empty
queue). So the forward's wake-up lag after a load grows with the recv thread's *non-blocking run* after
that completion, and a policy changes that run: under FIFO the recv thread often blocks at once in the
next head's save wait, under ``ready_queue`` it takes a ready task and runs its CPU work first.

Model, sized from the FIFO recording only (per queue):

- ``run_after``: per chain position, the recv thread's run after the load completed until it blocks,
  read off a replayed timeline: the rest of a merged batch's completions, then the next task served at
  once (the policy's own cost per dequeue included) up to its first wait that blocks or its first
  release point; 0 when the thread goes idle.
- Release points (where the recv thread's work stops holding the GIL) are recorded stage starts: the
  backend call (``backend_submit``: the copy), and the metadata build (``meta_build``) where that
  sleeps (the threaded replica's does, upstream's numpy build does not). Which of the two sets applies
  is chosen by the fit: the one whose least-absolute-deviation line ``lag = a + b * run`` over the FIFO
  recording's blocked forward waits has the smaller median absolute residual.
- A policy replay's lag at a position is the FIFO-recorded lag there (``a + b * run`` of the FIFO replay
  where the FIFO forward did not block) plus ``b * (run under the policy - run under FIFO)``, never
  below 0. FIFO gets no change (its runs are its own reference). The replay runs twice: once with the
  recorded lags, to read the policy's runs off its timeline, and once with the adjusted lags.
"""

from __future__ import annotations

import bisect
import statistics
from dataclasses import dataclass
from typing import Any

from otel_kvtrace.whatif.columns import NONE, QueueArrays
from otel_kvtrace.whatif.engine import QueueReplay, replay_queue
from otel_kvtrace.whatif.policy import Policy

RELEASES = ("copy", "meta+copy")
"""The release-point sets the fit chooses from."""
MIN_POINTS = 30
"""Below this many blocked forward waits with a run the fit is not made (no adjustment)."""


@dataclass(slots=True, frozen=True)
class GilModel:
    """``lag = intercept + slope * run`` (ns), over ``points`` blocked forward waits of the FIFO recording."""

    slope: float
    intercept: float
    release: str
    points: int
    loop_ns: int
    """The recv thread's loop from a load event to ``get()``: the median dispatch gap of a busy thread."""
    residual_ns: float
    """Median absolute residual of the fit (the mean is the stall tail's: 17-445 us over 8 runs)."""


def release_points(q: QueueArrays, release: str) -> list[int]:
    """Per task, the work offset (as ``work_ns``) where its recv-thread work first stops holding the GIL;
    -1: none recorded (the task's work runs until it blocks in a wait or ends)."""
    out = []
    for t in q.tasks:
        cands = [x for x in (t.copy_at_ns, t.meta_at_ns if release == "meta+copy" else None) if x is not None]
        out.append(min(cands) if cands else -1)
    return out


def run_after(rep: QueueReplay, release: list[int], dispatch_ns: int = 0, loop_ns: int = 0) -> list[list[int]]:
    """Per step and chain position: the recv thread's non-blocking run (ns) after that load completed.
    ``loop_ns``: the thread's loop from the event to ``get()`` (``task_done``, the loop; in a busy
    thread it is in the next task's dispatch gap, ``work_ns[0]``), run also when it then goes idle;
    ``dispatch_ns``: the policy's own ``get()`` cost, paid before it sleeps with tasks queued (a task it
    hands out pays what the replay charged it, ``rep.dispatched``)."""
    q = rep.arrays
    n = q.n
    by_start: dict[int, int] = {}
    batch_end: dict[int, int] = {}
    for j in range(n):
        s = rep.start[j]
        if s == NONE:
            continue
        if s not in by_start or j < by_start[s]:
            by_start[s] = j
        batch_end[s] = max(batch_end.get(s, NONE), rep.complete[j])
    arrivals = sorted(rep.arr)
    starts = sorted(s for s in rep.start if s != NONE)
    out = []
    for chain in q.chain:
        row = []
        for i in chain:
            c = rep.complete[i]
            end = batch_end.get(rep.start[i], c)
            run = max(0, end - c)  # the rest of a merged batch: its members' events are set one by one
            j = by_start.get(end)
            if j is not None and j != i and rep.start[j] == end:
                run += (rep.dispatched[j] if rep.dispatched is not None else dispatch_ns) + _run_into(rep, j, release)
            elif bisect.bisect_right(arrivals, end) > bisect.bisect_right(starts, end):
                run += loop_ns + dispatch_ns  # tasks queued, none served now: the decision runs, then sleeps
            else:
                run += loop_ns  # an empty queue: get() blocks at once, as queue.Queue's
            row.append(run)
        out.append(row)
    return out


def _run_into(rep: QueueReplay, j: int, release: list[int]) -> int:
    """Task ``j``'s run, as a work offset, from its replayed start (past its cost per dequeue) to its first
    blocking point: a release point, or the end of its first run of work (:func:`_runs`: a wait not met)."""
    _, _, first_end = _runs(rep, j)[0]
    return max(0, release[j] if 0 <= release[j] <= first_end else first_end)


def fit(q: QueueArrays, fifo: QueueReplay) -> GilModel | None:
    """The model from the FIFO recording of one queue: ``lag`` = the recorded wake-up lag of every
    blocked forward wait, ``run`` = the recv thread's run after that load on the FIFO replay (which
    reproduces the recording). None when there are too few points."""
    best: GilModel | None = None
    loop = loop_gap(q)
    for release in RELEASES:
        runs = run_after(fifo, release_points(q, release), 0, loop)
        xs, ys = [], []
        for s, chain in enumerate(q.chain):
            for p in range(len(chain)):
                if q.lag[s][p] > 0:
                    xs.append(float(runs[s][p]))
                    ys.append(float(q.lag[s][p]))
        if len(xs) < MIN_POINTS or max(xs) == min(xs):
            continue
        a, b = lad_line(xs, ys)
        if b < 0:  # a lag that falls with the run is no GIL wait: a flat line, at the lags' median
            a, b = statistics.median(ys), 0.0
        res = statistics.median(abs(y - a - b * x) for x, y in zip(xs, ys, strict=True))
        model = GilModel(b, a, release, len(xs), loop, res)
        if best is None or res < best.residual_ns:
            best = model
    return best


def loop_gap(q: QueueArrays) -> int:
    """Median gap from a completion to the next dequeue when the next task was already queued (the
    recorded FIFO thread's own loop; :func:`otel_kvtrace.whatif.measured.busy_dispatch_ns` alike)."""
    gaps = []
    tasks = q.tasks
    for a, b in zip(tasks, tasks[1:]):
        if a.recorded_complete_ns is not None and b.recorded_start_ns is not None \
                and b.arrival_ns < a.recorded_complete_ns <= b.recorded_start_ns:
            gaps.append(b.recorded_start_ns - a.recorded_complete_ns)
    return int(statistics.median(gaps)) if gaps else 0


def lad_line(xs: list[float], ys: list[float], iterations: int = 30) -> tuple[float, float]:
    """Least-absolute-deviation line ``y = a + b x`` (iteratively reweighted least squares): the lag's
    tail (a stalled thread, a preempted CPU: tens of ms in one wait) does not pull the slope, which an
    ordinary least-squares fit over these points lets it do (slope 3.1 with correlation 0.03 on ``hol``)."""
    w = [1.0] * len(xs)
    a = b = 0.0
    for _ in range(iterations):
        sw = sum(w)
        mx = sum(wi * x for wi, x in zip(w, xs, strict=True)) / sw
        my = sum(wi * y for wi, y in zip(w, ys, strict=True)) / sw
        sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(w, xs, strict=True))
        if sxx <= 0:
            break
        b = sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, xs, ys, strict=True)) / sxx
        a = my - b * mx
        w = [1.0 / max(abs(y - a - b * x), 1000.0) for x, y in zip(xs, ys, strict=True)]
    return a, b


def adjusted_lags(q: QueueArrays, model: GilModel, fifo_runs: list[list[int]],
                  policy_runs: list[list[int]]) -> list[list[int]]:
    """Per step and position, the forward's wake-up lag under the policy (see the module docstring)."""
    out = []
    for s, chain in enumerate(q.chain):
        row = []
        for p in range(len(chain)):
            base = q.lag[s][p] if q.lag[s][p] > 0 else model.intercept + model.slope * fifo_runs[s][p]
            row.append(max(0, int(base + model.slope * (policy_runs[s][p] - fifo_runs[s][p]))))
        out.append(row)
    return out


# ---- the send thread's copy, woken behind the recv thread ------------------------------------------------
#
# The send thread sleeps in each save's copy (``backend_submit``) and, when the sleep ends, needs the GIL
# back; while the recv thread runs Python without blocking it waits, so the copy ends behind the end of
# that run. A policy moves the recv thread's runs, so it moves these waits (measured on the real
# 0.23.0.post1 recv thread: the copies of saves 3-5 ended 6-37 us earlier under ``ready_queue``, where
# the recv thread slept in its own copy instead of running beside them; docs/whatif.md, "Replay model").
# Sized from the FIFO recording, per queue:
#
# - per save position in a step, the copy's uncontended duration: a low quantile (``UNCONTENDED_Q``) of
#   its recorded durations;
# - the send thread's run from taking the GIL back to the copy's end (``tail_ns``): the median, over
#   the FIFO copies during whose second half a recv-thread run ended, of the copy's end minus that end;
# - so the send thread wakes ``wake[k] = uncontended - tail`` into the copy at position ``k``, and waits
#   there for the rest of any recv-thread run in progress. A policy's save gets the difference between
#   that wait on its replayed timeline and on the FIFO replay's (FIFO gets none).

UNCONTENDED_Q = 0.1
"""The quantile of a save position's recorded copy durations taken as its duration without a GIL wait."""


@dataclass(slots=True, frozen=True)
class SendModel:
    """Where in each save's copy the send thread wakes and needs the GIL back."""

    wake: list[int]
    """Per save position in a step: the copy's offset (ns) at which the send thread wakes."""
    tail_ns: int
    """The send thread's run from taking the GIL back to the copy's end (median of ``points``)."""
    points: int


def recv_busy(rep: QueueReplay, release: str) -> list[tuple[int, int]]:
    """The recv thread's GIL-holding runs on a replayed timeline, sorted: each served task's work from its
    start (the policy's cost per dequeue included), less the waits that block, its backend call (it
    sleeps in the copy) and, with ``release == "meta+copy"``, its metadata build. Only for replays of
    whole tasks (a merged batch's own timeline is not rebuilt): [] when ``rep`` merged any."""
    if rep.batches:
        return []
    q = rep.arrays
    out: list[tuple[int, int]] = []
    for i in range(q.n):
        if rep.start[i] == NONE:
            continue
        t = q.tasks[i]
        holes = [(t.copy_at_ns, t.copy_at_ns + t.backend_submit_ns)] if t.copy_at_ns is not None else []
        if release == "meta+copy" and t.meta_at_ns is not None:
            holes.append((t.meta_at_ns, t.meta_at_ns + t.meta_ns))
        for at, x0, x1 in _segments(rep, i):
            out.extend((at + a - x0, at + b - x0) for a, b in _less(x0, x1, holes))
    out.sort()
    merged: list[tuple[int, int]] = []
    for a, b in out:  # pieces that touch are one run (the thread did not let go of the GIL between them)
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
        else:
            merged.append((a, b))
    return merged


def _segments(rep: QueueReplay, i: int) -> list[tuple[int, int, int]]:
    """Task ``i``'s work between its blocking waits on ``rep``'s timeline: (replayed start, first work
    offset, last work offset) per segment, offsets as ``work_ns`` (the policy's cost per dequeue before 0)."""
    q = rep.arrays
    d = rep.dispatched[i] if rep.dispatched is not None else 0
    at, x = rep.start[i], -d
    work = (q.w0[i] + d, q.w1[i], q.w2[i], q.w3[i])
    ready = (rep.eff_rs[i], rep.eff_rg[i], rep.rl[i])
    lag = (q.ws[i], q.wg[i], q.wl[i])
    out = []
    for k in range(4):
        out.append((at, x, x + work[k]))
        at += work[k]
        x += work[k]
        if k < 3 and ready[k] != NONE and ready[k] > at:
            at = ready[k] + lag[k]
    return out


def _less(a: int, b: int, holes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``[a, b)`` less ``holes`` (work offsets), as non-empty intervals."""
    parts = [(a, b)]
    for h0, h1 in holes:
        parts = [p for x0, x1 in parts for p in ((x0, min(x1, h0)), (max(x0, h1), x1)) if p[0] < p[1]]
    return parts


def _copies(rep: QueueReplay) -> list[tuple[int, int, int, int]]:
    """(step, save position, replayed copy start, recorded copy duration) of every replayed save with a
    recorded copy."""
    q = rep.arrays
    if q.send is None or rep.send_post is None:
        return []
    return [(s, k, post + q.send[s][k][6], q.send[s][k][7])
            for s, posts in enumerate(rep.send_post) for k, post in enumerate(posts) if q.send[s][k][6] != NONE]


def fit_send(fifo: QueueReplay, busy: list[tuple[int, int]]) -> SendModel | None:
    """The model from the FIFO replay (which reproduces the recording) and its recv-thread runs; None
    without recorded copies or with fewer than ``MIN_POINTS`` copies a run ended in."""
    copies = _copies(fifo)
    by_pos: dict[int, list[int]] = {}
    for _, k, _, d in copies:
        by_pos.setdefault(k, []).append(d)
    if not copies or not busy:
        return None
    uncontended = {k: sorted(ds)[int(UNCONTENDED_Q * (len(ds) - 1))] for k, ds in by_pos.items()}
    ends = [y for _, y in busy]
    tails = []
    for _, k, c, d in copies:
        j = bisect.bisect_right(ends, c + d) - 1
        if j >= 0 and ends[j] > c + uncontended[k] // 2:
            tails.append(c + d - ends[j])
    if len(tails) < MIN_POINTS:
        return None
    tail = int(statistics.median(tails))
    wake = [max(0, uncontended.get(k, 0) - tail) for k in range(max(by_pos) + 1)]
    return SendModel(wake, tail, len(tails))


def copy_waits(rep: QueueReplay, busy: list[tuple[int, int]], model: SendModel) -> dict[tuple[int, int], int]:
    """(step, save position) -> the send thread's wait for the GIL at its copy's wake-up on ``rep``'s
    timeline: the rest of the recv-thread run in progress then, 0 when none is."""
    starts = [x for x, _ in busy]
    out = {}
    for s, k, c, _ in _copies(rep):
        w = c + model.wake[k] if k < len(model.wake) else c
        j = bisect.bisect_right(starts, w) - 1
        out[(s, k)] = busy[j][1] - w if j >= 0 and busy[j][1] > w else 0
    return out


def save_extra(rep: QueueReplay, fifo_waits: dict[tuple[int, int], int], policy_waits: dict[tuple[int, int], int]
               ) -> list[list[int]]:
    """Per step and save position, the policy's copy wait minus FIFO's (0 where either is unknown)."""
    q = rep.arrays
    return [[policy_waits.get((s, k), 0) - fifo_waits.get((s, k), 0) if (s, k) in fifo_waits else 0
             for k in range(len(saves))] for s, saves in enumerate(q.send or [])]


# ---- the send thread's build wake-up, behind the recv thread's build ---------------------------------------
#
# On the threaded replica both transfer threads build a layer's addresses after a short sleep
# (``spend_meta_build``). Two such sleeps that began together are ended by one timer interrupt, and the
# recv thread, put on the CPU first, runs its Python up to its copy's sleep before the send thread runs
# (scheduler events, docs/whatif.md, "The final layer's miss, measured to the sleep": under FIFO at
# ``hol``'s saves 2 and 6, under ``ready_queue`` at save 4 too, where the recv thread builds layers 5-6
# while save 4 builds). A policy moves the recv thread's builds, so it moves these waits. Sized from the
# FIFO recording, per queue:
#
# - a save's work before its NPU sync (``send_pre``) *meets* a recv build when that recv task's
#   ``meta_build`` ends in the second half of it (the send thread asleep in its own build then);
# - ``tail_ns``: the median, over the meetings of the FIFO recording whose save's sync started after the
#   met copy did, of the sync start minus that copy start (then the send thread's own Python);
# - a save's own work: as recorded where it met none; where it met one, the median recorded work of its
#   position over the saves that met none;
# - its wait = the met task's copy start + tail - (start + own work), none when its own work would have
#   ended before the met build did (so at most that task's run from its build's end to its copy plus the
#   tail: a FIFO save slow for another reason keeps the rest); a policy's save gets its wait on the
#   policy's timeline minus FIFO's, before its NPU sync (FIFO gets none).


@dataclass(slots=True, frozen=True)
class BuildModel:
    """A save's pre-sync work meeting a recv build: the tail after the recv copy's start, and each FIFO
    save's own work before its NPU sync."""

    tail_ns: int
    own: dict[tuple[int, int], int]
    """(step, save position) -> the save's own pre-sync work (ns), without a meeting."""
    points: int


def recv_builds(rep: QueueReplay) -> list[tuple[int, int]]:
    """(replayed end of its ``meta_build``, replayed start of its copy) of every served recv task with both
    recorded in one run of its work (no blocking wait between them: across one the recv thread lets go of
    the CPU), sorted; [] for a replay that merged batches (their own timeline is not rebuilt)."""
    if rep.batches:
        return []
    q = rep.arrays
    out = []
    for i, t in enumerate(q.tasks):
        if rep.start[i] == NONE or t.meta_at_ns is None or t.copy_at_ns is None:
            continue
        end, copy = t.meta_at_ns + t.meta_ns, t.copy_at_ns
        for n, (at, x0, x1) in enumerate(_runs(rep, i)):
            # an end at a run's first offset ended the run before it (a blocking wait came between)
            if (x0 < end or n == 0) and end <= copy <= x1:
                out.append((at + end - x0, at + copy - x0))
                break
    out.sort()
    return out


def _runs(rep: QueueReplay, i: int) -> list[tuple[int, int, int]]:
    """Task ``i``'s :func:`_segments` joined where no wait blocked between them."""
    out: list[tuple[int, int, int]] = []
    for at, x0, x1 in _segments(rep, i):
        if out and out[-1][0] + out[-1][2] - out[-1][1] == at:
            out[-1] = (out[-1][0], out[-1][1], x1)
        else:
            out.append((at, x0, x1))
    return out


def meetings(rep: QueueReplay, builds: list[tuple[int, int]]
             ) -> dict[tuple[int, int], tuple[int, int, tuple[int, int] | None]]:
    """(step, save position) -> (pre-sync start, end, the met recv build (its end, its copy start) with the
    latest copy start, or None)."""
    ends = [e for e, _ in builds]
    out = {}
    for s, windows in enumerate(rep.send_pre or []):
        for k, (a, b) in enumerate(windows):
            if b <= a:
                continue
            met = builds[bisect.bisect_left(ends, (a + b) // 2):bisect.bisect_right(ends, b)]
            out[(s, k)] = (a, b, max(met, key=lambda x: x[1]) if met else None)
    return out


def fit_build(fifo: QueueReplay, builds: list[tuple[int, int]]) -> BuildModel | None:
    """The model from the FIFO replay (which reproduces the recording) and its recv builds
    (:func:`recv_builds`); None without ``MIN_POINTS`` meetings whose save ended after the met copy
    started."""
    met = meetings(fifo, builds)
    tails = [b - m[1] for a, b, m in met.values() if m is not None and m[1] <= b]
    if len(tails) < MIN_POINTS:
        return None
    alone: dict[int, list[int]] = {}
    for (_, k), (a, b, m) in met.items():
        if m is None:
            alone.setdefault(k, []).append(b - a)
    typical = {k: int(statistics.median(v)) for k, v in alone.items()}
    own = {key: (typical.get(key[1], b - a) if m is not None else b - a) for key, (a, b, m) in met.items()}
    return BuildModel(int(statistics.median(tails)), own, len(tails))


def build_waits(rep: QueueReplay, builds: list[tuple[int, int]], model: BuildModel) -> dict[tuple[int, int], int]:
    """(step, save position) -> the save's wait behind a recv build (``builds``: :func:`recv_builds` of
    ``rep``) it meets on ``rep``'s timeline (0: it meets none, or the met run ended before the save's own
    work would)."""
    out = {}
    for key, (a, b, m) in meetings(rep, builds).items():
        end = a + model.own.get(key, b - a)
        if m is None or end < m[0]:  # none met, or the save's own work would have ended before that build did
            out[key] = 0
        else:  # so at most the recv thread's run from that build's end to its copy, and the tail
            out[key] = max(0, m[1] + model.tail_ns - end)
    return out


def pre_extra(rep: QueueReplay, fifo_waits: dict[tuple[int, int], int], policy_waits: dict[tuple[int, int], int]
              ) -> list[list[int]]:
    """Per step and save position (every recorded save), the policy's build wait minus FIFO's (0 where either
    is unknown)."""
    return [[policy_waits[(s, k)] - fifo_waits[(s, k)] if (s, k) in fifo_waits and (s, k) in policy_waits else 0
             for k in range(len(saves))] for s, saves in enumerate(rep.arrays.send or [])]


# ---- both models on one queue -----------------------------------------------------------------------------

@dataclass(slots=True)
class Coupling:
    """What the FIFO replay of one queue gives both models: the forward's wake-up lag and the send
    thread's copy wake-up, each behind the recv thread's runs."""

    forward: GilModel | None
    release: str
    """The release-point set (``RELEASES``): the forward's fit's, else the copy alone."""
    release_at: list[int]
    """Per task, its first release point (:func:`release_points`)."""
    fifo_runs: list[list[int]]
    send: SendModel | None
    fifo_waits: dict[tuple[int, int], int]
    build: BuildModel | None = None
    fifo_build_waits: dict[tuple[int, int], int] | None = None

    @classmethod
    def fit(cls, arrays: QueueArrays, fifo: QueueReplay) -> Coupling:
        forward = fit(arrays, fifo)
        release = forward.release if forward is not None else RELEASES[0]
        release_at = release_points(arrays, release)
        runs = run_after(fifo, release_at, 0, forward.loop_ns) if forward is not None else []
        busy = recv_busy(fifo, release) if arrays.send is not None else []  # no saves recorded: no send model
        send = fit_send(fifo, busy)
        waits = copy_waits(fifo, busy, send) if send is not None else {}
        builds = recv_builds(fifo) if arrays.send is not None else []
        build = fit_build(fifo, builds) if builds else None
        return cls(forward, release, release_at, runs, send, waits, build,
                   build_waits(fifo, builds, build) if build is not None else None)


def replay_policy(arrays: QueueArrays, policy: Policy, coupling: Coupling | None, *, feedback: str,
                  reference: list[int] | None, dispatch: int = 0, decision: int = 0) -> QueueReplay:
    """One policy's replay: plain, then again with the forward's wake-up lags that the recv thread's runs
    on it give, then again with the send thread's copy waits and build waits those runs give (None: plain
    only).
    ``dispatch`` / ``decision``: the policy's costs per dequeue (``replay_queue``'s ``dispatch_ns`` /
    ``decision_ns``)."""
    kw: dict[str, Any] = {"feedback": feedback, "dispatch_ns": dispatch, "decision_ns": decision,
                          "reference_end": reference, "shift_steps": True}
    rep = replay_queue(arrays, policy, **kw)
    if coupling is None:
        return rep
    if coupling.forward is not None:
        runs = run_after(rep, coupling.release_at, dispatch + decision, coupling.forward.loop_ns)
        kw["lag_ns"] = adjusted_lags(arrays, coupling.forward, coupling.fifo_runs, runs)
        rep = replay_queue(arrays, policy, **kw)
    after = before = None
    if coupling.send is not None:
        busy = recv_busy(rep, coupling.release)
        if busy:
            after = save_extra(rep, coupling.fifo_waits, copy_waits(rep, busy, coupling.send))
    if coupling.build is not None and coupling.fifo_build_waits is not None and not rep.batches:
        before = pre_extra(rep, coupling.fifo_build_waits, build_waits(rep, recv_builds(rep), coupling.build))
    if after is not None or before is not None:
        rep = replay_queue(arrays, policy, save_extra_ns=after, pre_extra_ns=before, **kw)
    return rep
