"""Brute-force HOL reference, written straight from the definition (design.md section 4: within one step
of one queue, with the head blocked only while its own dependencies are unmet, docs/analysis.md) for the
property test.

Deliberately naive: for every head h, every one of its wait spans and every later task j, build the
interval j contributes, then take unions with plain interval arithmetic. It shares no code or shortcut
with ``queries/hol_intervals.sql`` (which uses a suffix minimum and gaps-and-islands).
"""

from __future__ import annotations

from collections.abc import Sequence

from synthetic_traces import QueueSpec, SynthTask

WAIT_STAGES = ("save_cpu_wait", "save_npu_sync", "gate_cond_wait", "gate_npu_sync", "slot_release_wait")

Interval = tuple[int, int]


def union(intervals: list[Interval]) -> list[Interval]:
    """Disjoint, sorted, non-touching intervals covering the same instants as ``intervals``."""
    merged: list[list[int]] = []
    for start, end in sorted(i for i in intervals if i[0] < i[1]):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def subtract(base: list[Interval], minus: list[Interval]) -> list[Interval]:
    """Instants of ``base`` not in ``minus`` (both unions)."""
    out: list[Interval] = []
    for start, end in base:
        pieces = [(start, end)]
        for m_start, m_end in minus:
            next_pieces = []
            for p_start, p_end in pieces:
                if m_end <= p_start or m_start >= p_end:
                    next_pieces.append((p_start, p_end))
                    continue
                if p_start < m_start:
                    next_pieces.append((p_start, m_start))
                if m_end < p_end:
                    next_pieces.append((m_end, p_end))
            pieces = next_pieces
        out.extend(pieces)
    return union(out)


def reference_hol(queues: Sequence[tuple[QueueSpec, Sequence[SynthTask]]]) -> dict:
    """``{(head_cid, class): (intervals, evidence_cid, evidence_ready)}`` for every HOL head."""
    result: dict = {}
    for spec, tasks in queues:
        for h in tasks:
            waits = [h.stages[s] for s in WAIT_STAGES if s in h.stages]
            # HOL is within a step: the step's final-layer task releases its leases, so no task of a
            # later step may legally pass h, however early it is ready.
            later = [j for j in tasks if j.seq > h.seq and j.step == h.step and not j.final_layer]
            proven: list[Interval] = []
            possible_or_proven: list[Interval] = []
            own_lo = max(h.enqueue, h.ready_lo)  # h surely still waits for a dependency before this
            own_hi = max(h.enqueue, h.ready)  # ... and possibly before this
            for ws, we in waits:
                for j in later:
                    proven.append((max(ws, j.enqueue, j.ready), min(we, own_lo)))
                    possible_or_proven.append((max(ws, j.enqueue, j.ready_lo), min(we, own_hi)))
            proven_u = union(proven)
            possible_u = subtract(union(possible_or_proven), proven_u)
            for cls, intervals, key in (("proven", proven_u, "hi"), ("possible", possible_u, "lo")):
                if not intervals:
                    continue
                def ready_of(j: SynthTask) -> int:
                    return max(j.enqueue, j.ready if key == "hi" else j.ready_lo)
                evidence = min(later, key=lambda j: (ready_of(j), j.seq))
                cid = spec.correlation_id(h.step, h.layer_id)
                ev_cid = spec.correlation_id(evidence.step, evidence.layer_id)
                result[(cid, cls)] = (intervals, ev_cid, ready_of(evidence))
    return result
