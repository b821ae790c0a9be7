"""The woken forward's wait for the GIL behind the recv thread (docs/whatif.md, "Forward wake-up and the GIL").

When the recv thread sets a load event, the forward blocked on it wakes, but it runs only once it holds
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

from otel_kvtrace.whatif.columns import NONE, QueueArrays
from otel_kvtrace.whatif.engine import QueueReplay

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
    ``dispatch_ns``: the policy's own ``get()`` cost, paid before it hands out a task or sleeps."""
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
                run += dispatch_ns + _run_into(rep, j, release)
            elif bisect.bisect_right(arrivals, end) > bisect.bisect_right(starts, end):
                run += loop_ns + dispatch_ns  # tasks queued, none served now: the decision runs, then sleeps
            else:
                run += loop_ns  # an empty queue: get() blocks at once, as queue.Queue's
            row.append(run)
        out.append(row)
    return out


def _run_into(rep: QueueReplay, j: int, release: list[int]) -> int:
    """Task ``j``'s run from its replayed start to its first blocking point (a wait not met, a release
    point)."""
    q = rep.arrays
    start = rep.start[j]
    work = (q.w0[j], q.w1[j], q.w2[j], q.w3[j])
    ready = (rep.eff_rs[j], rep.eff_rg[j], rep.rl[j])
    at = release[j]
    t = 0
    for k in range(4):
        if 0 <= at <= t + work[k]:
            return max(at, t)
        t += work[k]
        if k < 3 and ready[k] != NONE and ready[k] > start + t:
            return t
    return t


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
