"""``gate_group``: tasks sharing a gate are served as one batch (one backend call).

The head is taken in FIFO order. If it has a gate and is not the step's final-layer task, the thread
waits for that gate to open (it would block on it anyway), then takes the head and every queued task of
the same step and gate as one batch. The batch waits for every member's save and slot, runs the members'
work with one backend call fewer per extra member (``QueueArrays.call_overhead_ns``), and sets the
members' load events in seq order. The batch is contiguous (:func:`otel_kvtrace.schedule.rules.gate_batch`,
the same definition the threaded replica runs live): it ends at the final-layer task (H3) and at a task
whose save or gate depends on a load not yet completed (e.g. a slot-chain successor of another member, H1).
"""

from __future__ import annotations

from otel_kvtrace.schedule import rules
from otel_kvtrace.whatif.engine import QueueState
from otel_kvtrace.whatif.policy import INF, Policy


class GateGroup(Policy):
    name = "gate_group"
    head_runs_while_waiting = True  # live: get() is FIFO, the head runs into its gate wait

    def select(self, state: QueueState, now: int) -> list[int] | int:
        head = state.head()
        if head >= state.n_arrived:
            return INF
        q = state.q
        gate = q.gate[head]
        if gate < 0 or q.final[head]:
            return [head]
        state.ready_at(head)
        opens = state.eff_rg[head]
        if opens > now:
            return opens
        step = q.step[head]
        behind = range(head + 1, state.n_arrived)
        k = rules.gate_batch(step, gate, state.prog[step],
                             ((q.step[j], q.gate[j], q.final[j], q.need[j]) for j in behind))
        return [head, *behind[:k]]
