"""The replay engine: one recv queue, one policy, a small event loop over plain lists and heaps.

Model (docs/whatif.md):
- One server (the recv thread), non-preemptive. A served task runs ``work[0]``, waits for its save
  (H1), runs ``work[1]``, waits for its gate (S1), runs ``work[2]``, waits for its external slot (H2),
  runs ``work[3]``; it completes (sets its load event) at the end.
- Dependency times are the recorded ones, moved by first-order feedback through the forward: the
  gate ``G_c`` and the save of layer ``s`` come after the forward passed layer ``c`` (``s``); the forward
  keeps its recorded compute gaps between load waits, so when a replayed load completes earlier or
  later than recorded, the forward and every dependency behind it move by the same amount
  (``feedback="delay_only"``: only later). This also enforces the slot chain (H1) and the attention
  boundary: nothing behind a layer's pass can happen before the replayed pass.
- Times are rebased to the queue's first arrival (small ints); ``NONE`` marks "no such time".
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from otel_kvtrace.schedule import rules
from otel_kvtrace.whatif.columns import NONE, QueueArrays
from otel_kvtrace.whatif.policy import INF, Policy

__all__ = ["FEEDBACKS", "NONE", "QueueArrays", "QueueReplay", "QueueState", "ReplayStalled", "replay_queue"]


class ReplayStalled(RuntimeError):
    """The policy asked to wait but nothing can ever happen (a policy bug or inconsistent input)."""


class QueueState:
    """Mutable replay state of one queue under one policy; what ``Policy.select`` reads."""

    __slots__ = (
        "batches",
        "blocked",
        "busy_end",
        "busy_start",
        "complete",
        "arr",
        "delay_only",
        "decision",
        "dispatch",
        "dispatched",
        "shift",
        "shift_steps",
        "eff_rg",
        "eff_rl",
        "eff_rs",
        "fwd_arrive",
        "fwd_end",
        "head_ptr",
        "held_final",
        "index",
        "lags",
        "merged",
        "n",
        "n_arrived",
        "n_served",
        "passed",
        "phase",
        "prog",
        "q",
        "ready",
        "reference_end",
        "pre_extra",
        "save_extra",
        "send_done",
        "send_post",
        "send_pre",
        "served",
        "start",
        "step_left",
        "waiting",
    )

    def __init__(self, q: QueueArrays, index: bool, feedback: str = "full", dispatch_ns: int = 0,
                 reference_end: list[int] | None = None, shift_steps: bool = True,
                 lag_ns: list[list[int]] | None = None, save_extra_ns: list[list[int]] | None = None,
                 decision_ns: int = 0, pre_extra_ns: list[list[int]] | None = None) -> None:
        if feedback not in FEEDBACKS:
            raise ValueError(f"feedback: must be one of {FEEDBACKS}, got {feedback!r}")
        self.delay_only = feedback == "delay_only"
        self.dispatch = dispatch_ns
        self.decision = decision_ns
        self.arr = list(q.arr)
        """Replayed arrivals: a step's tasks are enqueued by the forward, so they move with its shift."""
        self.shift = [0] * len(q.chain)
        """Per step: replayed minus reference end of the previous step's forward (0 for the first)."""
        self.reference_end = reference_end if reference_end is not None else [
            e[-1] if e else NONE for e in q.rec_end]
        """Per step, the forward end the next step's recorded arrivals go with (the FIFO replay's in
        ``replay_run``, so FIFO's own small replay error does not compound from step to step)."""
        self.shift_steps = shift_steps
        self.lags = lag_ns if lag_ns is not None else q.lag
        """Per step and chain position, the forward's wake-up lag after the load (default: as recorded;
        :mod:`otel_kvtrace.whatif.gil` adjusts it for a policy)."""
        n = q.n
        self.q = q
        self.n = n
        self.start = [NONE] * n
        self.complete = [NONE] * n
        self.passed = [NONE] * n
        self.eff_rs = list(q.rs)
        self.eff_rg = list(q.rg)
        # external slot releases, moved with their step's shift (a sibling connector's send of the slot
        # belongs to the same engine step: it comes later when the step does)
        self.eff_rl = list(q.rl)
        self.served = bytearray(n)
        self.n_served = 0
        self.n_arrived = 0
        self.head_ptr = 0
        self.step_left = list(q.step_count)
        self.prog = [0] * len(q.chain)
        self.fwd_end = [[NONE] * len(c) for c in q.chain]
        self.fwd_arrive = [[NONE] * len(c) for c in q.chain]
        self.index = index
        self.waiting: list[tuple[int, int]] = []
        self.ready: list[int] = []
        self.blocked: list[list[int]] = [[] for _ in q.chain]
        self.held_final = [-1] * len(q.chain)
        self.batches = 0
        self.phase = bytearray(n)
        self.busy_start: list[int] = []
        self.busy_end: list[int] = []
        self.send_done: list[list[int]] = [[] for _ in q.chain]
        self.dispatched = [0] * n
        """Per task, the policy's cost per dequeue charged when it was handed out (:meth:`dequeue_cost`)."""
        self.merged = [False] * n
        """Per task, whether it ran in a merged batch (``gate_group``)."""
        self.send_post: list[list[int]] = [[] for _ in q.chain]
        """Per step and save, when its work after the device point started (its copy is in it)."""
        self.save_extra = save_extra_ns
        """Per step and save, time added to that work (None: as recorded; :mod:`otel_kvtrace.whatif.gil`)."""
        self.send_pre: list[list[tuple[int, int]]] = [[] for _ in q.chain]
        """Per step and save, its work before the NPU sync as replayed: (start, end); (t, t) without one."""
        self.pre_extra = pre_extra_ns
        """Per step and save, time added to its work before the NPU sync (None: as recorded; ``gil.py``)."""

    # ---- what policies read ---------------------------------------------------------------------
    def head(self) -> int:
        """Lowest-seq unserved task (may not have arrived yet; compare with ``n_arrived``)."""
        p = self.head_ptr
        served = self.served
        n = self.n
        while p < n and served[p]:
            p += 1
        self.head_ptr = p
        return p

    def refresh(self, now: int) -> None:
        """Move arrived tasks whose readiness has come (``<= now``) from ``waiting`` to ``ready``."""
        waiting = self.waiting
        ready = self.ready
        served = self.served
        while waiting and waiting[0][0] <= now:
            i = heapq.heappop(waiting)[1]
            if not served[i]:
                heapq.heappush(ready, i)

    def next_ready_time(self) -> int:
        """Earliest readiness among arrived, not-yet-ready tasks (``INF`` when none)."""
        return self.waiting[0][0] if self.waiting else INF

    def hold_final(self, i: int) -> None:
        """Park a final-layer task until it is the last unserved task of its step (H3)."""
        self.held_final[self.q.step[i]] = i

    def ready_at(self, i: int) -> int:
        """max(arrival, effective dependency times) of task ``i`` (uses what has completed so far)."""
        q = self.q
        self._effective(i)
        t = self.arr[i]
        for r in (self.eff_rs[i], self.eff_rg[i], self.eff_rl[i]):
            t = max(t, r)
        return t

    def sleep_lag(self, i: int) -> int:
        """For a thread sleeping in ``get()`` until task ``i``'s last dependency is met: how much later than
        that it starts ``i`` (``serve`` then adds ``i``'s recorded work, dispatch gap included). The
        wake-up latency of that wait as recorded (the queue's typical one for the kind when ``i``'s own
        wait did not block), less ``i``'s recorded dispatch gap: the loop before ``get()`` ran before the
        sleep. Call after :meth:`ready_at`."""
        q = self.q
        r = max(self.eff_rs[i], self.eff_rg[i], self.eff_rl[i])
        if r == NONE or r <= self.arr[i]:
            return 0
        kind, own = ((0, q.ws[i]) if r == self.eff_rs[i] else (1, q.wg[i]) if r == self.eff_rg[i] else (2, q.wl[i]))
        lag = own if own > 0 else q.typical_wake[kind]
        return max(0, lag - (q.gap0[i] if q.gap0 is not None else 0))

    def waits_on_gate(self, i: int, now: int) -> bool:
        """Task ``i``'s save is met at ``now`` and its gate is not: it waits on device progress only (the
        live queue then hands the head out to block in its own wait)."""
        self._effective(i)
        return self.eff_rs[i] <= now < self.eff_rg[i]

    def determinable(self, i: int) -> bool:
        """Every load the forward must pass before ``i``'s save/gate dependency has completed."""
        q = self.q
        return not rules.chain_blocks(q.need[i], self.prog[q.step[i]])

    # ---- engine side ----------------------------------------------------------------------------
    def _effective(self, i: int) -> None:
        q = self.q
        s = q.step[i]
        prog = self.prog[s]
        k = q.ks[i]
        if 0 <= k < prog:
            j = q.send_index[i] if q.send_index is not None else -1
            if j >= 0:
                self.eff_rs[i] = self._save_time(s, j, q.rs[i], self.fwd_end[s][k])
            else:
                self.eff_rs[i] = _shifted(q.rs[i], self.fwd_end[s][k], q.rec_end[s][k], self.delay_only)
        k = q.kg[i]
        if 0 <= k < prog:
            self.eff_rg[i] = _shifted(q.rg[i], self.fwd_end[s][k], q.rec_end[s][k], self.delay_only)

    def _save_time(self, s: int, j: int, recorded: int, fwd_end: int) -> int:
        """Save ``j`` of step ``s`` on the send thread (FIFO server, :mod:`otel_kvtrace.whatif.saves`)
        under the replayed forward; the load sees it with its recorded lag after the save completed."""
        sends = self.q.send[s]  # type: ignore[index]
        done = self.send_done[s]
        extra = self.save_extra[s] if self.save_extra is not None else None
        more = self.pre_extra[s] if self.pre_extra is not None else None
        prev = done[-1] if done else NONE
        while len(done) <= j:
            k = len(done)
            pos, issue, pre, dev, post = sends[k][:5]
            at = self.fwd_end[s][pos] + issue if pos >= 0 else issue + self.shift[s]
            t = at if prev == NONE else max(at, prev)
            t0 = t
            if pre >= 0:  # the NPU sync waits for the device, which moves with the issue
                t += max(0, pre + (more[k] if more is not None else 0))  # never before its own start
                self.send_pre[s].append((t0, t))
                if dev != NONE and at + dev > t:
                    t = at + dev
            else:
                self.send_pre[s].append((t0, t0))
            self.send_post[s].append(t)
            prev = t + post + (extra[k] if extra is not None else 0)
            done.append(prev)
        rec_done = sends[j][5]
        t = done[j] + (recorded - rec_done if recorded != NONE else 0)
        if self.delay_only and recorded != NONE:
            t = max(t, recorded)
        return max(fwd_end, t)

    def admit(self, now: int) -> None:
        arr = self.arr
        n = self.n
        while self.n_arrived < n and arr[self.n_arrived] <= now and self.step_known(self.n_arrived):
            i = self.n_arrived
            self.n_arrived = i + 1
            if self.index:
                self._enlist(i)

    def _enlist(self, i: int) -> None:
        # a task that has not started can always run its first work segment (before any wait)
        heapq.heappush(self.waiting, (self.arr[i], i))

    def dequeue_cost(self) -> int:
        """The policy's cost for the task handed out now: ``dispatch`` always, ``decision`` (its probe of the
        head) only when another arrived task is still queued (alone, the live queue hands it out unprobed)."""
        return self.dispatch + (self.decision if self.n_arrived - self.n_served > 1 else 0)

    def serve(self, batch: list[int], now: int) -> int:
        """Run ``batch`` from ``now``; return the time the thread is free again."""
        q = self.q
        if len(batch) == 1:
            i = batch[0]
            if self.served[i]:
                raise ReplayStalled(f"task seq={q.tasks[i].seq} served twice")
            self._effective(i)
            d = self.dispatched[i] = self.dequeue_cost()
            t = now + d + q.w0[i]
            r = self.eff_rs[i]
            if t < r:
                t = r + q.ws[i]
            t += q.w1[i]
            r = self.eff_rg[i]
            if t < r:
                t = r + q.wg[i]
            t += q.w2[i]
            r = self.eff_rl[i]
            if t < r:
                t = r + q.wl[i]
            self.passed[i] = t
            t += q.w3[i]
            self.start[i] = now
            self.complete[i] = t
            self.busy_start.append(now)
            self.busy_end.append(t)
            self._after(i)
            return t
        return self._serve_batch(batch, now)

    def gate_passed_at(self, i: int, now: int) -> int:
        """When task ``i``, served from ``now``, leaves its gate wait: its work and save wait before the
        gate run first (the live thread holds the task while it waits; ``gate_group`` claims the batch
        members then)."""
        q = self.q
        self.ready_at(i)
        t = now + self.dequeue_cost() + q.w0[i]
        if t < self.eff_rs[i]:
            t = self.eff_rs[i] + q.ws[i]
        t += q.w1[i]
        return self.eff_rg[i] + q.wg[i] if t < self.eff_rg[i] else t

    def _serve_batch(self, batch: list[int], now: int) -> int:
        """A merged batch as the replica's ``gate_group`` runs it: the head's work up to and through its
        gate wait; then each member's work before the copy (its dispatch gap left out: it is claimed
        inside the head's task) and save wait; the members' copies in one backend call (one call
        overhead and each member's ``completion`` fewer); the load events, the head's first, each
        member's after the thread's loop and dequeue again (its recorded dispatch gap and the policy's
        cost per dequeue: ``get()`` hands each member out for its event and ``task_done``)."""
        q = self.q
        for i in batch:
            if self.served[i]:
                raise ReplayStalled(f"task seq={q.tasks[i].seq} served twice")
            self._effective(i)
        head, members = batch[0], batch[1:]
        gap0 = q.gap0 if q.gap0 is not None else [0] * q.n
        d = self.dispatched[head] = self.dequeue_cost()
        t = now + d + q.w0[head]
        t = (self.eff_rs[head] + q.ws[head] if t < self.eff_rs[head] else t) + q.w1[head]
        rg = max(self.eff_rg[i] for i in batch)
        rg = max(rg, *(self.arr[m] for m in members))
        t = rg + max(q.wg[i] for i in batch) if t < rg else t
        claimed = t
        for m in members:
            t += max(0, q.w0[m] - gap0[m])
            t = (self.eff_rs[m] + q.ws[m] if t < self.eff_rs[m] else t) + q.w1[m]
        w2 = sum(q.w2[i] for i in batch)
        w3 = sum(q.w3[i] for i in batch)
        saving = (len(batch) - 1) * q.call_overhead_ns + sum(q.done[i] for i in batch)
        take = min(saving, w3)
        w3 -= take
        w2 -= min(saving - take, w2)
        t += w2
        rl = max(self.eff_rl[i] for i in batch)
        t = rl + max(q.wl[i] for i in batch) if t < rl else t
        passed = t
        t += w3
        self.batches += 1
        self.busy_start.append(now)
        for k, i in enumerate(batch):
            if k:
                t += gap0[i] + self.dispatch
            t += q.done[i]
            self.start[i] = now if k == 0 else claimed
            self.merged[i] = True
            self.passed[i] = passed
            self.complete[i] = t
            self._after(i)
        self.busy_end.append(t)
        return t

    def advance(self, i: int, now: int) -> int:
        """Run task ``i`` from where it stopped until it completes or reaches a wait point; at a wait
        whose dependency is not met, or (unless ``i`` is the head) after having run work, it is set aside
        with its progress kept and re-indexed by when it can continue.
        Returns the time the thread is free again. The API for a cooperative policy (none is built in: the live recv thread hands out whole
        tasks, ``policies/ready_queue.py``)."""
        q = self.q
        if self.served[i]:
            raise ReplayStalled(f"task seq={q.tasks[i].seq} advanced after completion")
        ph = self.phase[i]
        t = now
        if ph == 0:
            self.start[i] = now
            d = self.dispatched[i] = self.dequeue_cost()
            t += d + q.w0[i]
            ph = 1
        det = self.determinable(i)
        if det:
            self._effective(i)
        while True:
            if ph == 1:
                r, w, lag = self.eff_rs[i], q.w1[i], q.ws[i]
            elif ph == 2:
                r, w, lag = self.eff_rg[i], q.w2[i], q.wg[i]
            else:
                r, w, lag = self.eff_rl[i], q.w3[i], q.wl[i]
            if ph < 3 and not det and (q.ks[i] >= 0 if ph == 1 else q.kg[i] >= 0):
                self.phase[i] = ph
                self.blocked[q.step[i]].append(i)
                break
            if r > t:
                self.phase[i] = ph
                heapq.heappush(self.waiting, (r + lag, i))  # noticed after the recorded wake-up lag
                break
            if t > now and i != self.head():
                # a wait point is a scheduling point: a lower-seq task may have become runnable meanwhile
                self.phase[i] = ph
                heapq.heappush(self.waiting, (t, i))
                break
            if ph == 3:
                self.passed[i] = t
                t += w
                self.complete[i] = t
                self._after(i)
                break
            t += w
            ph += 1
        if t > now:
            self.busy_start.append(now)
            self.busy_end.append(t)
        return t

    def step_known(self, i: int) -> bool:
        """Task ``i``'s arrival is final: the first step's, or the previous step's forward has ended."""
        s = self.q.step[i]
        return s == 0 or self.prog[s - 1] == len(self.q.chain[s - 1])

    def _next_step_arrivals(self, s: int) -> None:
        """Step ``s``'s forward passed its last load wait: a later end starts the next step that much later
        (its tasks are enqueued by the forward, after this step: closed loop), and with it the step's
        external slot releases (a sibling connector's send of the slot belongs to the same engine step).
        Never earlier: the traces do not hold the forward's work between steps, so whether the next step
        could have started earlier is unknown; a faster policy gets no cross-step credit (conservative)."""
        q = self.q
        if not self.shift_steps or s + 1 >= len(q.chain) or not q.chain[s]:
            return
        rec = self.reference_end[s]
        d = self.fwd_end[s][-1] - rec if rec != NONE and self.fwd_end[s][-1] != NONE else 0
        if d < 0:  # later only: no cross-step credit for a faster policy
            d = 0
        self.shift[s + 1] = d
        if d:
            arr, base, rl = self.arr, q.arr, self.eff_rl
            for i in q.chain[s + 1]:
                arr[i] = base[i] + d
                if q.rl[i] != NONE:
                    rl[i] = q.rl[i] + d

    def _progress_time(self, i: int) -> int:
        """When task ``i`` can run again: now for a task not started, else its pending wait's time."""
        ph = self.phase[i]
        q = self.q
        if ph == 0:
            return self.arr[i]
        self._effective(i)
        if ph == 1:
            return self.eff_rs[i] + q.ws[i]
        if ph == 2:
            return self.eff_rg[i] + q.wg[i]
        return self.eff_rl[i] + q.wl[i]

    def _after(self, i: int) -> None:
        q = self.q
        self.served[i] = 1
        self.n_served += 1
        s = q.step[i]
        left = self.step_left[s] - 1
        self.step_left[s] = left
        if left == 1 and self.held_final[s] >= 0:
            heapq.heappush(self.ready, self.held_final[s])
            self.held_final[s] = -1
        p = self.prog[s]
        if q.chain_pos[i] != p:
            return
        chain = q.chain[s]
        ends = self.fwd_end[s]
        arrives = self.fwd_arrive[s]
        rec_arrive = q.rec_arrive[s]
        gaps = q.gap[s]
        lags = self.lags[s]
        complete = self.complete
        while p < len(chain) and complete[chain[p]] != NONE:
            g = gaps[p - 1] if p > 0 else None
            arrive = ends[p - 1] + g if g is not None else rec_arrive[p] + (self.shift[s] if rec_arrive[p] != NONE else 0)
            c = complete[chain[p]] + lags[p]
            arrives[p] = arrive
            ends[p] = max(arrive, c)
            p += 1
        self.prog[s] = p
        if p == len(chain):
            self._next_step_arrivals(s)
        if self.index and self.blocked[s]:
            still = []
            for j in self.blocked[s]:
                if not rules.chain_blocks(q.need[j], p):
                    heapq.heappush(self.waiting, (self._progress_time(j), j))
                else:
                    still.append(j)
            self.blocked[s] = still


FEEDBACKS = ("full", "delay_only")


def _shifted(recorded: int, fwd_end: int, rec_fwd_end: int, delay_only: bool) -> int:
    """A dependency behind the forward's pass of a layer: the recorded time moved by the forward's
    shift at that layer (only later when ``delay_only``), never before the replayed pass itself."""
    r = recorded
    if r != NONE and rec_fwd_end != NONE and (fwd_end > rec_fwd_end or not delay_only):
        r += fwd_end - rec_fwd_end
    return max(fwd_end, r)


@dataclass(slots=True)
class QueueReplay:
    """Result of replaying one queue under one policy (times rebased to ``arrays.t0``)."""

    policy: str
    arrays: QueueArrays
    start: list[int]
    complete: list[int]
    passed: list[int]
    eff_rs: list[int]
    eff_rg: list[int]
    fwd_arrive: list[list[int]]
    fwd_end: list[list[int]]
    batches: int
    busy: list[tuple[int, int]]
    """Intervals the recv thread was occupied (running work or blocked in a wait), in order."""
    arrivals: list[int] | None = None
    """Replayed arrivals (moved with the forward's shift per step); None = as recorded (``arrays.arr``)."""
    eff_rl: list[int] | None = None
    """Replayed external slot releases (moved with their step's shift); None = as recorded (``arrays.rl``)."""
    send_post: list[list[int]] | None = None
    """Per step, the replayed start of each save's work after the device point (the saves replayed so far)."""
    dispatched: list[int] | None = None
    """Per task, the policy's cost per dequeue as charged when it was handed out (``dispatch_ns``, plus
    ``decision_ns`` when another task was queued)."""
    merged: list[bool] | None = None
    """Per task, whether it ran in a merged batch (``gate_group``)."""
    send_pre: list[list[tuple[int, int]]] | None = None
    """Per step, each replayed save's work before its NPU sync, (start, end); (t, t) where none is recorded."""

    @property
    def arr(self) -> list[int]:
        """Arrival per task, as replayed."""
        return self.arrivals if self.arrivals is not None else self.arrays.arr

    @property
    def rl(self) -> list[int]:
        """External slot release per task, as replayed."""
        return self.eff_rl if self.eff_rl is not None else self.arrays.rl


def replay_queue(q: QueueArrays, policy: Policy, *, feedback: str = "full", dispatch_ns: int = 0,
                 decision_ns: int = 0, reference_end: list[int] | None = None, shift_steps: bool = True,
                 lag_ns: list[list[int]] | None = None, save_extra_ns: list[list[int]] | None = None,
                 pre_extra_ns: list[list[int]] | None = None) -> QueueReplay:
    """Replay one queue under ``policy``: the loop pops decisions until every task has completed.

    ``feedback``: ``full`` moves forward-driven dependencies (gates, saves) earlier or later with the
    replayed forward (assumes a host-bound device); ``delay_only`` only moves them later (conservative).
    ``dispatch_ns``: the policy's own recv-thread cost per dequeue (its ``get()`` decision) on top of
    FIFO's, paid at the start of every task (batch); 0 = the recorded FIFO dispatch only.
    ``decision_ns``: a cost paid only when another arrived task is queued (the probe of the head,
    :mod:`otel_kvtrace.whatif.decision`).
    Step arrivals: a step's tasks are enqueued by the forward after the previous step, so they move later
    by how much the previous step's forward ended after ``reference_end`` (per step; default the recorded
    ends; never earlier; ``shift_steps=False``: as recorded).
    ``lag_ns``: per step and chain position, the forward's wake-up lag after the load (default
    ``q.lag``, as recorded under FIFO). ``save_extra_ns``: per step and save, time added to the save's
    work after its device point (default none; :mod:`otel_kvtrace.whatif.gil`); ``pre_extra_ns``: the
    same before its NPU sync (so a device not done yet still bounds it).
    """
    state = QueueState(q, policy.uses_ready_index, feedback, dispatch_ns, reference_end, shift_steps, lag_ns,
                       save_extra_ns, decision_ns, pre_extra_ns)
    n = q.n
    arr = q.arr
    select = policy.select
    now = arr[0]
    while state.n_served < n:
        state.admit(now)
        choice = select(state, now)
        if isinstance(choice, list):
            now = state.serve(choice, now)
            continue
        if isinstance(choice, tuple):
            now = state.advance(choice[0], now)
            continue
        k = state.n_arrived
        nxt = state.arr[k] if k < n and state.step_known(k) else INF
        wake = min(nxt, choice)
        if wake >= INF or wake <= now:
            raise ReplayStalled(
                f"policy {policy.name!r} waits at t={now} with {n - state.n_served} task(s) left (wake={wake})")
        now = wake
    return QueueReplay(policy.name, q, state.start, state.complete, state.passed, state.eff_rs, state.eff_rg,
                       state.fwd_arrive, state.fwd_end, state.batches,
                       list(zip(state.busy_start, state.busy_end, strict=True)), state.arr, state.eff_rl,
                       state.send_post, state.dispatched, state.merged, state.send_pre)
