"""What a replay means for the consumer: forward waits, TTFT estimate, tails, in-flight, HOL, validation.

Forward model (docs/whatif.md): per step the forward passes its load waits in layer order. It reaches
the first one at its recorded arrival; between waits it keeps its recorded compute gap; at each wait
it leaves at max(arrival, replayed load completion). ``consumer_wait`` of a layer is the time spent
there. The TTFT estimate of a step is the time from the step's first enqueue to the forward leaving its
last load wait (the compute after it does not depend on the policy and is left out).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from otel_kvtrace.whatif.engine import NONE, QueueReplay


def quantile(values: list[int] | list[float], q: float) -> float:
    """Linear-interpolated quantile (numpy's default), 0 for an empty list."""
    if not values:
        return 0.0
    xs = sorted(values)
    pos = (len(xs) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


@dataclass(slots=True)
class StepFigures:
    """Per step of one queue: forward waits and TTFT estimate under one policy (ns)."""

    step: int
    consumer_wait_ns: int
    ttft_ns: int
    layer_wait_ns: list[int]


def step_figures(rep: QueueReplay) -> list[StepFigures]:
    """Forward figures per step (see the module docstring for the model)."""
    q = rep.arrays
    out = []
    for s, chain in enumerate(q.chain):
        arrives = rep.fwd_arrive[s]
        ends = rep.fwd_end[s]
        waits = [ends[p] - arrives[p] for p in range(len(chain)) if arrives[p] != NONE]
        first = min(rep.arr[i] for i in chain)
        last = ends[-1] if ends and ends[-1] != NONE else max(rep.complete[i] for i in chain)
        out.append(StepFigures(q.step_values[s], sum(waits), last - first, waits))
    return out


def peak_inflight(arr: list[int], complete: list[int]) -> int:
    """Max number of tasks enqueued but not completed (completions at a time count first)."""
    events = [(t, 1) for t in arr] + [(t, -1) for t in complete]
    events.sort()
    cur = peak = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return peak


@dataclass(slots=True)
class Validation:
    """FIFO replay vs recorded completion times of one or more queues."""

    tasks: int
    median_abs_error_ns: float
    p95_abs_error_ns: float
    median_service_ns: float
    median_error_pct: float
    p95_error_pct: float
    max_error_pct: float

    @property
    def ok(self) -> bool:
        return self.tasks > 0 and self.median_error_pct <= 5.0


def validate_fifo(reps: list[QueueReplay]) -> Validation:
    """Absolute error of FIFO-replayed completions, as % of the median service time (target <= 5%)."""
    errors: list[int] = []
    services: list[int] = []
    for rep in reps:
        q = rep.arrays
        for i in range(q.n):
            rec = q.rec_complete[i]
            if rec == NONE:
                continue
            errors.append(abs(rep.complete[i] - rec))
            services.append(q.w0[i] + q.w1[i] + q.w2[i] + q.w3[i])
    return validation_from(errors, services)


def validation_from(errors: list[int], services: list[int]) -> Validation:
    """``Validation`` from per-task absolute errors and service times (ns)."""
    if not errors:
        return Validation(0, 0.0, 0.0, 0.0, float("inf"), float("inf"), float("inf"))
    med_service = max(quantile(services, 0.5), 1.0)
    med = quantile(errors, 0.5)
    p95 = quantile(errors, 0.95)
    return Validation(len(errors), med, p95, med_service, 100 * med / med_service, 100 * p95 / med_service,
                      100 * max(errors) / med_service)


@dataclass(slots=True)
class HolEvent:
    """A head whose dependency wait had a bypass-ready task behind it (design §4)."""

    queue: str
    seq: int
    step: int
    layer_id: int
    duration_ns: int
    evidence_seq: int
    evidence_ready_ns: int


def hol_events(rep: QueueReplay) -> list[HolEvent]:
    """HOL events on a replayed FIFO timeline (design §4: union of bypass-ready intervals per head wait).

    A later task j is bypass-ready at t when it belongs to the head's step, has arrived, its dependencies
    are met (its readiness as the replay computed it) and it is not the step's final-layer task. A
    next-step task behind the head is not HOL (``queries/hol_intervals.sql`` partitions by queue and step).
    """
    q = rep.arrays
    n = q.n
    out: list[HolEvent] = []
    ready = [max(rep.arr[j], rep.eff_rs[j], rep.eff_rg[j], rep.rl[j]) for j in range(n)]
    order = sorted(range(n), key=lambda i: rep.start[i])
    for h in order:
        t = rep.start[h] + q.w0[h]
        intervals = []
        step_h = q.step[h]
        for r, w, lag in ((rep.eff_rs[h], q.w1[h], q.ws[h]), (rep.eff_rg[h], q.w2[h], q.wg[h]),
                          (rep.rl[h], q.w3[h], q.wl[h])):
            if r > t:
                intervals.append((t, r))  # blocked while the dependency is unmet (not the wake-up lag)
                t = r + lag
            t += w
        if not intervals:
            continue
        total = 0
        best_j = -1
        best_e = 0
        for a, b in intervals:
            e_min = None
            j_min = -1
            j = h + 1
            while j < n and rep.arr[j] < b:
                if q.step[j] == step_h and not q.final[j] and rep.start[j] >= a:
                    e = max(rep.arr[j], ready[j])
                    if e < b and (e_min is None or e < e_min):
                        e_min, j_min = e, j
                j += 1
            if e_min is not None:
                total += b - max(a, e_min)
                if best_j < 0:
                    best_j, best_e = j_min, e_min
        if total > 0:
            task = q.tasks[h]
            out.append(HolEvent(task.queue, task.seq, task.step, task.layer_id, total, q.tasks[best_j].seq,
                                best_e + q.t0))
    return out


@dataclass(slots=True)
class QueueFigures:
    """Everything the verdict needs from one queue under one policy."""

    policy: str
    tasks: int
    steps: list[StepFigures]
    task_latency_p99_ns: float
    peak_inflight: int
    makespan_ns: int
    throughput_tasks_per_s: float
    batches: int
    hol: list[HolEvent] = field(default_factory=list)


def queue_figures(rep: QueueReplay, *, with_hol: bool = False) -> QueueFigures:
    """Summarise one queue replay."""
    q = rep.arrays
    lat = [rep.complete[i] - rep.arr[i] for i in range(q.n)]
    makespan = max(rep.complete) - rep.arr[0]
    return QueueFigures(
        policy=rep.policy,
        tasks=q.n,
        steps=step_figures(rep),
        task_latency_p99_ns=quantile(lat, 0.99),
        peak_inflight=peak_inflight(rep.arr, rep.complete),
        makespan_ns=makespan,
        throughput_tasks_per_s=q.n * 1e9 / makespan if makespan > 0 else 0.0,
        batches=rep.batches,
        hol=hol_events(rep) if with_hol else [],
    )


def check_constraints(rep: QueueReplay) -> list[str]:
    """Every hard constraint checked on a replayed order, from its outputs; returns the violations.

    Single server (the thread's busy intervals never overlap; start >= arrival); every task served;
    H1 (no write before the save ready time as the replay moved it, nor before the slot-chain
    predecessor's load completed); attention boundary (no copy before every load of a layer <= the
    gate layer completed, nor before the gate time); H2 (no copy before the slot release, both as
    replayed and as recorded: ``ReplayTask.recorded_slot_release_ns``, so an input that lost the
    constraint is caught); H3 (the
    final-layer task starts after every other task of its step completed).
    """
    q = rep.arrays
    bad: list[str] = []
    n = q.n
    if any(c == NONE for c in rep.complete):
        bad.append("a task was never served")
        return bad
    last = NONE
    for start, end in rep.busy:
        if start < last:
            bad.append(f"the recv thread runs two things at once at t={start}")
        if end < start:
            bad.append(f"busy interval ends before it starts at t={start}")
        last = max(last, end)
    for i in range(n):
        seq = q.tasks[i].seq
        if rep.start[i] < rep.arr[i]:
            bad.append(f"seq {seq}: starts before it arrived")
        p = rep.passed[i]
        if p < rep.start[i] or p > rep.complete[i]:
            bad.append(f"seq {seq}: copy point outside its service")
        for name, r in (("save (H1)", rep.eff_rs[i]), ("gate", rep.eff_rg[i]), ("slot (H2)", rep.rl[i])):
            if r != NONE and p < r:
                bad.append(f"seq {seq}: copy at {p} before its {name} ready time {r}")
        raw = q.tasks[i].recorded_slot_release_ns
        if raw is not None and p < raw - q.t0:
            bad.append(f"seq {seq}: copy at {p} before its recorded slot (H2) release {raw - q.t0}")
    by_step: dict[int, list[int]] = {}
    for i in range(n):
        by_step.setdefault(q.step[i], []).append(i)
    for i in range(n):
        task = q.tasks[i]
        for j in by_step[q.step[i]]:
            if j == i:
                continue
            lay = q.layer[j]
            if task.wait_for_save_layer is not None and lay <= task.wait_for_save_layer and j < i \
                    and rep.passed[i] < rep.complete[j]:
                bad.append(f"seq {task.seq}: writes before layer {lay} (slot chain, H1) completed")
            if task.gate_id is not None and lay <= task.gate_id and j < i and rep.passed[i] < rep.complete[j]:
                bad.append(f"seq {task.seq}: crosses the attention boundary of gate {task.gate_id} "
                           f"before layer {lay} loaded")
            if q.final[i] and rep.start[i] < rep.complete[j]:
                bad.append(f"seq {task.seq}: final-layer task starts before seq {q.tasks[j].seq} completed (H3)")
    return bad
