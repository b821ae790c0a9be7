"""``gate_group``: tasks sharing a gate are served as one batch (one backend call).

The head is taken in FIFO order. If it has a gate and is not the step's final-layer task, the thread
runs the head into its gate wait (as the live thread does), and once the gate opened takes every task
of the same step and gate queued by then as one batch (``QueueState._serve_batch``): each member's
work and save wait, one backend call fewer per extra member (``QueueArrays.call_overhead_ns``), the
load events in seq order, each member's after the thread's loop and dequeue. The batch is contiguous (:func:`otel_kvtrace.schedule.rules.gate_batch`,
the same definition the threaded replica runs live): it ends at the final-layer task (H3) and at a task
whose save or gate depends on a load not yet completed (e.g. a slot-chain successor of another member, H1).
"""

from __future__ import annotations

from otel_kvtrace.schedule import rules
from otel_kvtrace.whatif.engine import QueueState
from otel_kvtrace.whatif.policy import INF, Policy


class GateGroup(Policy):
    name = "gate_group"

    def select(self, state: QueueState, now: int) -> list[int] | int:
        head = state.head()
        if head >= state.n_arrived:
            return INF
        q = state.q
        gate = q.gate[head]
        if gate < 0 or q.final[head]:
            return [head]
        # live: the head is handed out now and runs into its gate wait; the claim runs once the gate
        # opened and takes the tasks queued by then
        state.admit(state.gate_passed_at(head, now))
        step = q.step[head]
        behind = range(head + 1, state.n_arrived)
        k = rules.gate_batch(step, gate, state.prog[step],
                             ((q.step[j], q.gate[j], q.final[j], q.need[j]) for j in behind))
        return [head, *behind[:k]]
