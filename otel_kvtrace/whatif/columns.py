"""Policy-independent columns of one queue: what the engine reads, built once from ``ReplayTask``s.

Plain lists indexed by position in ``seq`` order (fast in CPython), times rebased to the queue's first
arrival, ``NONE`` for "no such time". Also the per-step forward chain (the loads the forward waits on,
in layer order, with their recorded arrival/leave times, compute gaps and wake-up lags) and, per task,
the chain position its save and gate dependencies sit behind.
"""

from __future__ import annotations

from dataclasses import dataclass

from otel_kvtrace.whatif.task import ReplayTask

NONE = -(1 << 62)


@dataclass(slots=True)
class QueueArrays:
    """Policy-independent columns of one queue, indexed by position in ``seq`` order."""

    tasks: list[ReplayTask]
    t0: int
    n: int
    arr: list[int]
    rs: list[int]
    rg: list[int]
    rl: list[int]
    w0: list[int]
    w1: list[int]
    w2: list[int]
    w3: list[int]
    done: list[int]
    ws: list[int]
    wg: list[int]
    wl: list[int]
    final: list[bool]
    step: list[int]
    step_values: list[int]
    gate: list[int]
    layer: list[int]
    rec_complete: list[int]
    ks: list[int]
    kg: list[int]
    need: list[int]
    chain: list[list[int]]
    chain_pos: list[int]
    rec_arrive: list[list[int]]
    rec_end: list[list[int]]
    gap: list[list[int | None]]
    lag: list[list[int]]
    """Forward wake-up lag per chain position: recorded wait end minus load completion when it blocked."""
    step_count: list[int]
    call_overhead_ns: int

    @classmethod
    def from_tasks(cls, tasks: list[ReplayTask]) -> QueueArrays:
        """Columns of one queue; ``tasks`` must share a queue and be in ``seq`` order."""
        if not tasks:
            raise ValueError("tasks: empty queue")
        n = len(tasks)
        t0 = min(t.arrival_ns for t in tasks)

        def rb(v: int | None) -> int:
            return NONE if v is None else v - t0

        arr = [t.arrival_ns - t0 for t in tasks]
        for i in range(1, n):
            arr[i] = max(arr[i], arr[i - 1])  # seq is enqueue order; clamp clock noise
        step_index: dict[int, int] = {}
        step = []
        for t in tasks:
            s = step_index.setdefault(t.step, len(step_index))
            step.append(s)
        nsteps = len(step_index)
        chain: list[list[int]] = [[] for _ in range(nsteps)]
        for i, t in enumerate(tasks):
            chain[step[i]].append(i)
        chain_pos = [0] * n
        rec_arrive: list[list[int]] = []
        rec_end: list[list[int]] = []
        gap: list[list[int | None]] = []
        lag: list[list[int]] = []
        layers_of: list[list[int]] = []
        for s in range(nsteps):
            c = sorted(chain[s], key=lambda i: (tasks[i].layer_id, i))
            chain[s] = c
            for p, i in enumerate(c):
                chain_pos[i] = p
            ra = [rb(tasks[i].consumer_wait_start_ns) for i in c]
            re = []
            for i in c:
                t = tasks[i]
                end = t.consumer_wait_end_ns if t.consumer_wait_end_ns is not None else t.recorded_complete_ns
                re.append(rb(end))
            gp: list[int | None] = []
            for p in range(len(c) - 1):
                gp.append(ra[p + 1] - re[p] if ra[p + 1] != NONE and re[p] != NONE else None)
            gp.append(None)
            lg = []
            for p, i in enumerate(c):
                rc = rb(tasks[i].recorded_complete_ns)
                blocked = ra[p] != NONE and rc != NONE and re[p] != NONE and ra[p] < rc < re[p]
                lg.append(re[p] - rc if blocked else 0)
            lag.append(lg)
            rec_arrive.append(ra)
            rec_end.append(re)
            gap.append(gp)
            layers_of.append([tasks[i].layer_id for i in c])

        def kpos(s: int, layer: int | None) -> int:
            if layer is None:
                return -1
            k = -1
            for p, lay in enumerate(layers_of[s]):
                if lay <= layer:
                    k = p
                else:
                    break
            return k

        ks = [kpos(step[i], t.wait_for_save_layer) if t.ready_save_ns is not None or t.wait_for_save_layer is not None
              else -1 for i, t in enumerate(tasks)]
        kg = [kpos(step[i], t.gate_id) if t.gate_id is not None else -1 for i, t in enumerate(tasks)]
        # a dependency on the task itself or a later one is inconsistent input: drop the link
        for i in range(n):
            if ks[i] >= 0 and chain[step[i]][ks[i]] >= i:
                ks[i] = -1
            if kg[i] >= 0 and chain[step[i]][kg[i]] >= i:
                kg[i] = -1
        need = [max(ks[i], kg[i]) for i in range(n)]
        step_count = [len(c) for c in chain]
        return cls(
            tasks=tasks, t0=t0, n=n, arr=arr,
            rs=[rb(t.ready_save_ns) for t in tasks],
            rg=[rb(t.ready_gate_ns) for t in tasks],
            rl=[rb(t.ready_slot_ns) for t in tasks],
            w0=[t.work_ns[0] for t in tasks], w1=[t.work_ns[1] for t in tasks],
            w2=[t.work_ns[2] for t in tasks], w3=[t.work_ns[3] for t in tasks],
            done=[min(t.completion_ns, t.work_ns[3] + t.work_ns[2]) for t in tasks],
            ws=[t.wake_ns[0] for t in tasks], wg=[t.wake_ns[1] for t in tasks], wl=[t.wake_ns[2] for t in tasks],
            final=[t.final_layer for t in tasks],
            step=step, step_values=list(step_index),
            gate=[-1 if t.gate_id is None else t.gate_id for t in tasks],
            layer=[t.layer_id for t in tasks],
            rec_complete=[rb(t.recorded_complete_ns) for t in tasks],
            ks=ks, kg=kg, need=need, chain=chain, chain_pos=chain_pos,
            rec_arrive=rec_arrive, rec_end=rec_end, gap=gap, lag=lag, step_count=step_count,
            call_overhead_ns=estimate_call_overhead(tasks),
        )


def estimate_call_overhead(tasks: list[ReplayTask]) -> int:
    """Fixed cost of one backend call: intercept of ``backend_submit_ns ~ a + b*bytes`` (least squares).

    Clamped to ``[0, min(backend_submit_ns)]``; 0 when bytes do not vary (not identifiable). Batching k
    tasks into one call (``gate_group``) saves ``(k-1)`` of it.
    """
    pts = [(t.bytes, t.backend_submit_ns) for t in tasks if t.backend_submit_ns > 0 and t.bytes > 0]
    if len(pts) < 3:
        return 0
    xs = [p[0] for p in pts]
    ys = [p[1] for p in pts]
    mx = sum(xs) / len(xs)
    my = sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return 0
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    a = my - b * mx
    return int(max(0.0, min(a, float(min(ys)))))
