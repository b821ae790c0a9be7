"""Replay input: one ``ReplayTask`` per recv task, built from the ``tasks`` table (or replica records).

A task is replayed as four work segments separated by three dependency waits, always in this order
(true for GVA on main and v0.23 and for the key path, research §1.3-1.5)::

    work[0] | wait save (H1) | work[1] | wait gate (S1) | work[2] | wait slot (H2) | work[3]

``work`` is what the recorded task spent on the recv thread *excluding* dependency waits: the gaps
between dequeue, the wait spans and completion (meta_build, h2d_stagger, backend_submit, completion
and untraced bookkeeping), plus the dispatch gap (``ts_dequeue - max(ts_enqueue, previous complete)``:
the thread's own wake-up and loop cost). A wait kind the task does not have has ready time ``None``.

Ready times (absolute epoch ns): save = max(``ts_dep_save_cpu``, ``ts_dep_save_npu``), gate =
max(``ts_dep_gate_record``, ``ts_dep_gate_npu``), slot = ``ts_dep_slot_release``. Bounded NPU times use
the upper bound (``bound="hi"``, conservative) or the lower bound (``bound="lo"``). A dependency time is
never later than the observed end of its wait (the waiter returned, so it was satisfied by then).
A slot-release wait that returned without blocking means the slot was free by the wait's start: an
exact release time is still kept (a policy may serve the task earlier than FIFO did), a bounded one is
capped at the wait start (``bound="hi"``) or dropped (``bound="lo"``); without a recorded time there is
no constraint.
When a dependency time is exact and the thread blocked on it, the delay between that time and the
wait's return (wake-up / synchronize latency) is kept per wait and paid again when a replayed wait
blocks (not for bounded times: there the gap is uncertainty, not latency).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from otel_kvtrace.record.model import stage_triples

logger = logging.getLogger("otel_kvtrace")

SAVE, GATE, SLOT = 0, 1, 2
WAIT_KINDS = ("save", "gate", "slot")
WAIT_STAGES: tuple[tuple[str, ...], ...] = (
    ("save_cpu_wait", "save_npu_sync"),
    ("gate_cond_wait", "gate_npu_sync"),
    ("slot_release_wait",),
)
WAIT_DEPS: tuple[tuple[str, ...], ...] = (("save_cpu", "save_npu"), ("gate_record", "gate_npu"), ("slot_release",))
BOUNDS = ("hi", "lo")


class ReplayInputError(ValueError):
    """The replay input is unusable; the message names the column or option."""


@dataclass(slots=True)
class ReplayTask:
    """One recv task as the replay sees it. Times are absolute ns (epoch, or virtual for the replica)."""

    queue: str
    seq: int
    step: int
    layer_id: int
    arrival_ns: int
    work_ns: tuple[int, int, int, int] = (0, 0, 0, 0)
    ready_save_ns: int | None = None
    ready_gate_ns: int | None = None
    ready_slot_ns: int | None = None
    final_layer: bool = False
    gate_id: int | None = None
    wait_for_save_layer: int | None = None
    wake_ns: tuple[int, int, int] = (0, 0, 0)
    """Per wait (save, gate, slot): how long after the exactly known dependency time the blocked thread
    returned (event wake-up / synchronize latency). Paid again only when a replayed wait blocks."""
    completion_ns: int = 0
    """The ``completion`` stage (backend return -> load event set); the tail of the last work segment."""
    backend_submit_ns: int = 0
    bytes: int = 0
    recorded_slot_release_ns: int | None = None
    """The exact ``ts_dep_slot_release`` as recorded (``None`` when absent or bounded): what
    ``check_constraints`` checks H2 against, independently of how ``ready_slot_ns`` was derived."""
    copy_at_ns: int | None = None
    """Recv-thread work (as ``work_ns``: waits excluded, dispatch gap included) from the dequeue to the
    start of the backend call, whose copy blocks the thread (``None``: no backend call recorded)."""
    dispatch_gap_ns: int = 0
    """The dispatch gap folded into ``work_ns[0]`` (:func:`add_dispatch_gaps`): the thread's loop from the
    previous completion (or the arrival) to this dequeue."""
    meta_at_ns: int | None = None
    """The same offset to the start of the ``meta_build`` stage (``None``: not recorded)."""
    meta_ns: int = 0
    """The ``meta_build`` stage's duration (the threaded replica sleeps in it)."""
    check_ns: tuple[int | None, int | None, int | None] = (None, None, None)
    """Per wait (save, gate, slot): its recorded duration where it returned without blocking (its
    dependency met by the wait's start, by the upper bound of a bounded NPU time whatever ``bound``: the
    readiness check alone, timed in situ); -1: it may have blocked or its dependency time is unknown;
    None: the task has no such wait recorded (:mod:`.decision`)."""
    recorded_start_ns: int | None = None
    recorded_complete_ns: int | None = None
    consumer_wait_start_ns: int | None = None
    consumer_wait_end_ns: int | None = None
    correlation_id: str = ""
    run_id: str = ""
    cfg_label: str = ""
    path: str = ""
    scheduler: str = ""
    """Recv policy the run was recorded under (``kvtrace.cfg.scheduler``; empty = not recorded = fifo)."""

    @property
    def service_ns(self) -> int:
        """Recv-thread time excluding dependency waits (the replay's service time)."""
        w = self.work_ns
        return w[0] + w[1] + w[2] + w[3]

    @property
    def ready_ns(self) -> int:
        """max(arrival, every dependency ready time)."""
        t = self.arrival_ns
        for r in (self.ready_save_ns, self.ready_gate_ns, self.ready_slot_ns):
            if r is not None and r > t:
                t = r
        return t


# ---- from rows of the ``tasks`` table ---------------------------------------------------------------
def _get(row: Mapping[str, Any], name: str) -> Any:
    value = row.get(name)
    if value is None:
        return None
    return value


def _int(value: Any) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _dep_time(row: Mapping[str, Any], dep: str, bound: str) -> int | None:
    exact = _int(_get(row, f"ts_dep_{dep}"))
    if exact is not None:
        return exact
    return _int(_get(row, f"ts_dep_{dep}_{bound}"))


def _stage(row: Mapping[str, Any], name: str) -> tuple[int, int] | None:
    start = _int(_get(row, f"{name}_start"))
    end = _int(_get(row, f"{name}_end"))
    if start is None or end is None:
        return None
    return start, end


def task_from_row(row: Mapping[str, Any], *, bound: str = "hi") -> ReplayTask:
    """One ``ReplayTask`` from a ``tasks`` row (docs/schema.md names). Dispatch gap is added later."""
    if bound not in BOUNDS:
        raise ReplayInputError(f"bound: must be one of {BOUNDS}, got {bound!r}")
    for col in ("queue", "seq", "step", "layer_id", "ts_enqueue"):
        if row.get(col) is None:
            raise ReplayInputError(f"tasks.{col}: missing (row {row.get('correlation_id', '?')})")
    arrival = int(row["ts_enqueue"])
    dequeue = _int(row.get("ts_dequeue"))
    complete = _int(row.get("ts_complete"))
    ready: list[int | None] = [None, None, None]
    wake = [0, 0, 0]
    waits: list[tuple[int, int] | None] = [None, None, None]
    check: list[int | None] = [None, None, None]
    for kind in (SAVE, GATE, SLOT):
        times = [t for t in (_dep_time(row, d, bound) for d in WAIT_DEPS[kind]) if t is not None]
        exact = all(_int(_get(row, f"ts_dep_{d}")) is not None for d in WAIT_DEPS[kind]
                    if _dep_time(row, d, bound) is not None)
        spans = [s for s in (_stage(row, n) for n in WAIT_STAGES[kind]) if s is not None]
        wait = (min(s[0] for s in spans), max(s[1] for s in spans)) if spans else None
        r = max(times) if times else None
        if wait is not None:
            met = [t for t in (_dep_time(row, d, "hi") for d in WAIT_DEPS[kind]) if t is not None]  # upper bounds
            check[kind] = wait[1] - wait[0] if met and max(met) <= wait[0] else -1
            if r is None or r > wait[1]:
                r = wait[1]  # satisfied no later than the waiter's return
            elif exact and r > wait[0]:
                wake[kind] = wait[1] - r  # blocked: the thread woke this long after the exact event time
            if kind == SLOT and wait[1] <= wait[0] and r is not None:
                # returned without blocking: the slot was free by the wait's start. An exact release
                # time stays the constraint (a policy serving this task earlier must still wait for it);
                # a bounded one is capped at the wait start (hi) or dropped (lo: possible, optimistic).
                if not times or (not exact and bound == "lo"):
                    r = None
                elif not exact:
                    r = min(r, wait[0])
        waits[kind] = wait
        ready[kind] = r
    work = [0, 0, 0, 0]
    if dequeue is not None and complete is not None:
        cursor = dequeue
        segment = 0
        for kind in (SAVE, GATE, SLOT):
            wait = waits[kind]
            if wait is None:
                continue
            work[segment] += max(0, wait[0] - cursor)
            cursor = max(cursor, wait[1])
            segment = kind + 1
        work[segment] += max(0, complete - cursor)
    elif complete is not None:
        work[3] = max(0, complete - max([arrival, *(r for r in ready if r is not None)]))
    cstage = _stage(row, "completion")
    bstage = _stage(row, "backend_submit")
    copy_at = _work_offset(bstage, dequeue, waits)
    mstage = _stage(row, "meta_build")
    meta_at = _work_offset(mstage, dequeue, waits)
    cwait = _stage(row, "consumer_wait")
    gate = _int(row.get("gate_id"))
    src = _int(row.get("wait_for_save_layer"))
    return ReplayTask(
        queue=str(row["queue"]),
        seq=int(row["seq"]),
        step=int(row["step"]),
        layer_id=int(row["layer_id"]),
        arrival_ns=arrival,
        work_ns=(work[0], work[1], work[2], work[3]),
        wake_ns=(wake[0], wake[1], wake[2]),
        check_ns=(check[0], check[1], check[2]),
        ready_save_ns=ready[SAVE],
        ready_gate_ns=ready[GATE],
        ready_slot_ns=ready[SLOT],
        final_layer=bool(row.get("final_layer") or False),
        gate_id=gate,
        wait_for_save_layer=src,
        completion_ns=(cstage[1] - cstage[0]) if cstage else 0,
        backend_submit_ns=(bstage[1] - bstage[0]) if bstage else 0,
        bytes=_int(row.get("bytes")) or 0,
        recorded_slot_release_ns=_int(_get(row, "ts_dep_slot_release")),
        copy_at_ns=copy_at,
        meta_at_ns=meta_at,
        meta_ns=(mstage[1] - mstage[0]) if mstage else 0,
        recorded_start_ns=dequeue,
        recorded_complete_ns=complete,
        consumer_wait_start_ns=cwait[0] if cwait else None,
        consumer_wait_end_ns=cwait[1] if cwait else None,
        correlation_id=str(row.get("correlation_id") or ""),
        run_id=str(row.get("run_id") or ""),
        cfg_label=str(row.get("cfg_label") or ""),
        path=str(row.get("path") or ""),
        scheduler=str(row.get("cfg_scheduler") or ""),
    )


def _work_offset(stage: tuple[int, int] | None, dequeue: int | None,
                 waits: list[tuple[int, int] | None]) -> int | None:
    """Recv-thread work (waits excluded) from the dequeue to ``stage``'s start; None without either."""
    if stage is None or dequeue is None or stage[0] < dequeue:
        return None
    cursor, total = dequeue, 0
    for wait in waits:
        if wait is not None and wait[0] <= stage[0]:
            total += max(0, wait[0] - cursor)
            cursor = max(cursor, wait[1])
    return total + max(0, stage[0] - cursor)


def add_dispatch_gaps(tasks: list[ReplayTask]) -> None:
    """Fold each task's dispatch gap (dequeue after max(enqueue, previous completion)) into work[0].

    ``tasks`` must be one queue in ``seq`` order. The gap is recv-thread time (wake-up, loop,
    ``task_done``), not a dependency wait, so it belongs to the service time.
    """
    prev: int | None = None
    for t in tasks:
        if t.recorded_start_ns is not None:
            base = t.arrival_ns if prev is None else max(t.arrival_ns, prev)
            gap = t.recorded_start_ns - base
            if gap > 0:
                w = t.work_ns
                t.work_ns = (w[0] + gap, w[1], w[2], w[3])
                t.dispatch_gap_ns = gap
                if t.copy_at_ns is not None:
                    t.copy_at_ns += gap
                if t.meta_at_ns is not None:
                    t.meta_at_ns += gap
        if t.recorded_complete_ns is not None:
            prev = t.recorded_complete_ns


def group_by_queue(tasks: Iterable[ReplayTask]) -> dict[str, list[ReplayTask]]:
    """Tasks per queue, each list in ``seq`` order."""
    out: dict[str, list[ReplayTask]] = {}
    for t in tasks:
        out.setdefault(t.queue, []).append(t)
    for lst in out.values():
        lst.sort(key=lambda t: t.seq)
    return out


def tasks_from_rows(rows: Iterable[Mapping[str, Any]], *, bound: str = "hi") -> list[ReplayTask]:
    """``ReplayTask``s from ``tasks`` rows (dicts), with dispatch gaps folded in, in (queue, seq) order.

    Rows without ``ts_complete`` (never served: the thread died, or the trace was cut) are left out, with
    a warning: their service time is unknown, and replaying them as free would flatter every policy.
    """
    kept = []
    skipped = 0
    for r in rows:
        if r.get("ts_complete") is None:
            skipped += 1
            continue
        kept.append(task_from_row(r, bound=bound))
    if skipped:
        logger.warning("whatif: %d task(s) without ts_complete left out of the replay", skipped)
    by_queue = group_by_queue(kept)
    out: list[ReplayTask] = []
    for lst in by_queue.values():
        add_dispatch_gaps(lst)
        out.extend(lst)
    return out


def tasks_from_duckdb(con: Any, *, where: str | None = None, bound: str = "hi") -> list[ReplayTask]:
    """``ReplayTask``s from the ``tasks`` table of a DuckDB connection (see docs/schema.md).

    ``where`` is an optional SQL filter, e.g. ``"path = 'gva'"``.
    """
    sql = "SELECT * FROM tasks"
    if where:
        sql += f" WHERE {where}"
    sql += " ORDER BY queue, seq"
    cur = con.execute(sql)
    cols = [d[0] for d in cur.description]
    rows = [dict(zip(cols, values, strict=True)) for values in cur.fetchall()]
    if not rows:
        raise ReplayInputError("tasks: no rows" + (f" match {where!r}" if where else ""))
    return tasks_from_rows(rows, bound=bound)


# ---- from replica / recorder TaskRecords -------------------------------------------------------------
_STAGE_NAMES = (
    "save_cpu_wait", "save_npu_sync", "gate_cond_wait", "gate_npu_sync", "meta_build", "h2d_stagger",
    "slot_release_wait", "backend_submit", "consumer_wait",
)
_DEP_NAMES = ("save_cpu", "save_npu", "gate_record", "gate_npu", "slot_release")


def row_from_record(rec: Any, *, run_id: str = "", cfg_label: str = "") -> dict[str, Any]:
    """A ``tasks``-shaped row from a ``record.model.TaskRecord`` (recv kind), in the record's clock."""
    q = rec.queue
    row: dict[str, Any] = {
        "queue": q.queue_id if q is not None else "queue",
        "correlation_id": f"{q.run_id if q else run_id}/{q.path if q else ''}/s{rec.step}/l{rec.layer_id}",
        "seq": rec.seq,
        "step": rec.step,
        "layer_id": rec.layer_id,
        "final_layer": rec.final_layer,
        "wait_for_save_layer": rec.wait_for_save_layer,
        "gate_id": rec.gate_id,
        "bytes": rec.nbytes,
        "ts_enqueue": rec.t_enqueue if rec.t_enqueue >= 0 else None,
        "ts_dequeue": rec.t_dequeue if rec.t_dequeue >= 0 else None,
        "ts_complete": rec.t_complete if rec.t_complete >= 0 else None,
        "run_id": run_id or (q.run_id if q else ""),
        "cfg_label": cfg_label,
        "path": q.path if q is not None else "",
    }
    deps = rec.deps
    for d, name in enumerate(_DEP_NAMES):
        if not rec.has_dep >> d & 1:
            continue
        lo, hi = deps[2 * d], deps[2 * d + 1]
        if lo < 0 and hi < 0:
            continue
        if lo == hi:
            row[f"ts_dep_{name}"] = lo
        else:
            row[f"ts_dep_{name}_lo"] = lo if lo >= 0 else None
            row[f"ts_dep_{name}_hi"] = hi if hi >= 0 else None
    seen: dict[str, tuple[int, int]] = {}
    for stage, start, end in stage_triples(rec.stages):
        name = _STAGE_NAMES[stage]
        if name in seen:
            s0, e0 = seen[name]
            seen[name] = (min(s0, start), max(e0, end))
        else:
            seen[name] = (start, end)
    if rec.t_backend_return >= 0 and rec.t_complete >= 0:
        seen["completion"] = (rec.t_backend_return, rec.t_complete)
    for name, (start, end) in seen.items():
        row[f"{name}_start"] = start
        row[f"{name}_end"] = end
    return row


def tasks_from_records(records: Sequence[Any], *, run_id: str = "", cfg_label: str = "",
                       bound: str = "hi") -> list[ReplayTask]:
    """``ReplayTask``s straight from recv ``TaskRecord``s (the replica's output), no export needed."""
    return tasks_from_rows((row_from_record(r, run_id=run_id, cfg_label=cfg_label) for r in records), bound=bound)
