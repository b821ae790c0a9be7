"""Policy-independent columns of one queue: what the engine reads, built once from ``ReplayTask``s.

Plain lists indexed by position in ``seq`` order (fast in CPython), times rebased to the queue's first
arrival, ``NONE`` for "no such time". Also the per-step forward chain (the loads the forward waits on,
in layer order, with their recorded arrival/leave times, compute gaps and wake-up lags) and, per task,
the chain position its save and gate dependencies sit behind.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

from otel_kvtrace.whatif.saves import SaveTask, device_lags
from otel_kvtrace.whatif.task import ReplayInputError, ReplayTask

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
    send: list[list[tuple[int, int, int, int, int, int, int, int]]] | None = None
    """Per step, the send thread's saves in enqueue order: (chain position the issue follows, issue
    lag after that forward pass or the rebased issue time when the position is -1, work before the NPU
    sync (-1: no sync recorded, the whole service is the work after the device point), the device's lag
    after the issue (``NONE``: none), work after the device point, recorded completion, the copy's
    start within that work (``NONE``: no copy recorded), the copy's recorded duration); None without
    recorded saves (save times then move with the forward alone; :mod:`otel_kvtrace.whatif.saves`)."""
    send_index: list[int] | None = None
    """Per task, the index in ``send[step]`` of its save source, or -1."""
    gap0: list[int] | None = None
    """Per task, the recorded dispatch gap inside ``w0`` (the loop before its dequeue)."""
    typical_wake: tuple[int, int, int] = (0, 0, 0)
    """Per wait kind (save, gate, slot): the median recorded wake-up latency over the waits that blocked
    (0 when none did): what a wait costs a task whose own recorded wait did not block."""

    @classmethod
    def from_tasks(cls, tasks: list[ReplayTask], saves: list[SaveTask] | None = None) -> QueueArrays:
        """Columns of one queue; ``tasks`` must share a queue and be in ``seq`` order. ``saves``: the
        same worker's recorded send-thread saves (:mod:`otel_kvtrace.whatif.saves`)."""
        if not tasks:
            raise ValueError("tasks: empty queue")
        t0 = min(t.arrival_ns for t in tasks)

        def rb(v: int | None) -> int:
            return NONE if v is None else v - t0

        arr = [t.arrival_ns - t0 for t in tasks]
        for i in range(1, len(arr)):
            arr[i] = max(arr[i], arr[i - 1])  # seq is enqueue order; clamp clock noise
        step_index: dict[int, int] = {}
        step = [step_index.setdefault(t.step, len(step_index)) for t in tasks]
        fwd = _ForwardChains.build(tasks, step, len(step_index), rb)
        ks, kg = _dependency_positions(tasks, step, fwd)
        send, send_index = _send_columns(tasks, step_index, fwd, saves, rb) if saves else (None, None)
        return cls(
            tasks=tasks, t0=t0, n=len(tasks), arr=arr,
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
            ks=ks, kg=kg, need=[max(a, b) for a, b in zip(ks, kg, strict=True)],
            chain=fwd.chain, chain_pos=fwd.chain_pos, rec_arrive=fwd.rec_arrive, rec_end=fwd.rec_end,
            gap=fwd.gap, lag=fwd.lag, step_count=[len(c) for c in fwd.chain],
            call_overhead_ns=estimate_call_overhead(tasks),
            send=send, send_index=send_index,
            gap0=[t.dispatch_gap_ns for t in tasks], typical_wake=_typical_wake(tasks),
        )


@dataclass(slots=True)
class _ForwardChains:
    """Per step: the loads the forward waits on, in layer order, with recorded times (rebased)."""

    chain: list[list[int]]
    chain_pos: list[int]
    layers: list[list[int]]
    rec_arrive: list[list[int]]
    rec_end: list[list[int]]
    gap: list[list[int | None]]
    lag: list[list[int]]

    @classmethod
    def build(cls, tasks: list[ReplayTask], step: list[int], nsteps: int,
              rb: Callable[[int | None], int]) -> _ForwardChains:
        out = cls([[] for _ in range(nsteps)], [0] * len(tasks), [], [], [], [], [])
        for i in range(len(tasks)):
            out.chain[step[i]].append(i)
        for s in range(nsteps):
            c = sorted(out.chain[s], key=lambda i: (tasks[i].layer_id, i))
            out.chain[s] = c
            for p, i in enumerate(c):
                out.chain_pos[i] = p
            arrive = [rb(tasks[i].consumer_wait_start_ns) for i in c]
            # without a recorded consumer wait, the forward is taken to leave when the load completed
            end = [rb(tasks[i].consumer_wait_end_ns if tasks[i].consumer_wait_end_ns is not None
                      else tasks[i].recorded_complete_ns) for i in c]
            gap: list[int | None] = [
                arrive[p + 1] - end[p] if arrive[p + 1] != NONE and end[p] != NONE else None
                for p in range(len(c) - 1)]
            gap.append(None)
            lag = []
            for p, i in enumerate(c):
                done = rb(tasks[i].recorded_complete_ns)
                blocked = arrive[p] != NONE and done != NONE and end[p] != NONE and arrive[p] < done < end[p]
                lag.append(end[p] - done if blocked else 0)
            out.layers.append([tasks[i].layer_id for i in c])
            out.rec_arrive.append(arrive)
            out.rec_end.append(end)
            out.gap.append(gap)
            out.lag.append(lag)
        return out


def _typical_wake(tasks: list[ReplayTask]) -> tuple[int, int, int]:
    out = []
    for kind in range(3):
        lags = sorted(t.wake_ns[kind] for t in tasks if t.wake_ns[kind] > 0)
        out.append(lags[len(lags) // 2] if lags else 0)
    return out[0], out[1], out[2]


def _send_columns(tasks: list[ReplayTask], step_index: dict[int, int], fwd: _ForwardChains,
                  saves: list[SaveTask], rb: Callable[[int | None], int]) -> tuple[list, list[int]]:
    """Per step the saves (see ``QueueArrays.send``) and per task the index of its save source."""
    send: list[list[tuple[int, int, int, int, int, int]]] = [[] for _ in step_index]
    where: list[dict[int, int]] = [{} for _ in step_index]
    prev_done: int | None = None
    for sv, dev in zip(saves, device_lags(saves), strict=True):  # enqueue order, one send thread
        s = step_index.get(sv.step)
        start = sv.enqueue_ns if prev_done is None else max(sv.enqueue_ns, prev_done)
        pre, post, resume = _split_at_sync(sv, start, dev)
        prev_done = sv.complete_ns
        if s is None:
            continue
        pos = bisect.bisect_right(fwd.layers[s], sv.layer_id) - 1
        end = fwd.rec_end[s][pos] if pos >= 0 else NONE
        issue = rb(sv.enqueue_ns) - end if end != NONE else rb(sv.enqueue_ns)
        where[s].setdefault(sv.layer_id, len(send[s]))
        copy_at, copy_ns = _copy_in(sv, resume)
        send[s].append((pos if end != NONE else -1, issue, pre, NONE if pre < 0 else dev, post, rb(sv.complete_ns),
                        copy_at, copy_ns))
    index = []
    for i, t in enumerate(tasks):
        s = step_index[t.step]
        index.append(where[s].get(t.wait_for_save_layer, -1) if t.wait_for_save_layer is not None else -1)
    return send, index


def _split_at_sync(sv: SaveTask, start: int, dev: int | None) -> tuple[int, int, int]:
    """(work before the NPU sync, work after the device point, where that work starts) of one recorded
    save served from ``start``; (-1, service, start) when no usable sync is recorded (the whole service
    is then work). After the device point: from the sync's end where it blocked on the device, else from
    its start (the sync's own few us are work)."""
    service = max(0, sv.complete_ns - start)
    if dev is None or sv.sync_start_ns is None or sv.sync_end_ns is None or sv.sync_start_ns < start:
        return -1, service, start
    device_at = sv.enqueue_ns + dev
    resume = sv.sync_end_ns if device_at > sv.sync_start_ns else sv.sync_start_ns
    return sv.sync_start_ns - start, max(0, sv.complete_ns - resume), resume


def _copy_in(sv: SaveTask, resume: int) -> tuple[int, int]:
    """(the copy's start after ``resume``, its duration); (NONE, 0) when no copy is recorded after it."""
    if sv.copy_start_ns is None or sv.copy_end_ns is None or sv.copy_start_ns < resume:
        return NONE, 0
    return sv.copy_start_ns - resume, sv.copy_end_ns - sv.copy_start_ns


def _dependency_positions(tasks: list[ReplayTask], step: list[int], fwd: _ForwardChains) -> tuple[list[int], list[int]]:
    """Per task, the chain position (last load of a layer <= the source/gate layer) its save and gate
    dependencies sit behind, or -1. A save of the task's own layer is not behind the forward (-1). A link
    that cannot be met raises ``ReplayInputError`` naming the tasks (``impossible_links``)."""
    ks: list[int] = []
    kg: list[int] = []
    bad = impossible_links(tasks, step, fwd)
    if bad:
        shown = "; ".join(bad[:5])
        raise ReplayInputError(
            f"queue {tasks[0].queue!r}: {len(bad)} task(s) wait for something that needs their own load first, "
            f"so no policy can serve them (a cycle; corrupted or mis-joined trace?): {shown}"
            + (f"; and {len(bad) - 5} more" if len(bad) > 5 else ""))
    for i, t in enumerate(tasks):
        s = step[i]
        for layer, out in ((t.wait_for_save_layer, ks), (t.gate_id, kg)):
            k = -1 if layer is None else bisect.bisect_right(fwd.layers[s], layer) - 1
            out.append(k if k >= 0 and fwd.chain[s][k] < i else -1)
    return ks, kg


def impossible_links(tasks: list[ReplayTask], step: list[int], fwd: _ForwardChains) -> list[str]:
    """Tasks whose save or gate happens after the forward passed a layer whose load is this task or a task
    queued after it: the forward passes a layer only after every load of a layer <= it completed, and one
    recv thread serves a queue, so the task waits (via the forward) on its own completion. A gate of the
    task's own layer is such a cycle (the attention boundary G_c covers layers <= c); a save of its own
    layer is taken as a save of the previous use of the buffer (no link), as the replica's layouts write it.
    """
    out = []
    for i, t in enumerate(tasks):
        s = step[i]
        for what, layer in (("save of layer", t.wait_for_save_layer), ("gate of layer", t.gate_id)):
            if layer is None or (what == "save of layer" and layer == t.layer_id):
                continue
            k = bisect.bisect_right(fwd.layers[s], layer) - 1
            if k >= 0 and fwd.chain[s][k] >= i:
                out.append(f"seq={t.seq} (step {t.step}, layer {t.layer_id}) waits for the {what} {layer}, "
                           f"behind the load of seq={tasks[fwd.chain[s][k]].seq}")
    return out


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
