"""``ready_queue``: dependency-aware, whole tasks: the decision of the live scheduler's ``get()``
(``otel_kvtrace.schedule.queue``), replayed. Per dequeue:

- the head goes when its waits are met now, when it is alone, or when the rules let no queued task pass
  it (it then blocks in its own waits, as FIFO);
- else the lowest-seq queued task that the rules let pass (:func:`rules.final_must_wait`, the buffer chain
  through the forward's progress) and whose waits are all met now goes, whole;
- else, when the head waits on its gate (device progress, no host signal), the head goes and blocks in
  its wait, as the live queue does; otherwise the thread sleeps until the first of those tasks' waits is
  met or a task arrives (the live queue is woken by the producer's signal or sleeps to a known time).

A served task runs to completion (``serve``): unlike the cooperative ``advance`` API of the engine, the
live recv thread never runs part of a task and sets it aside. Found by comparing the replay with the
live scheduler on the real 0.23 recv thread (docs/whatif.md, "The remaining misses, measured").

Hard constraints kept: a passing task's save (H1), gate (attention boundary) and external slot (H2)
times are met when it starts, with save and gate times the engine moves behind the forward's replayed
progress, so slot-chain successors never pass their predecessor; the step's final-layer task (lease
release, H3) does not pass until it is the last unserved task of its step; the head may always go (its
waits block it, as upstream's).
"""

from __future__ import annotations

from otel_kvtrace.schedule import rules
from otel_kvtrace.whatif.engine import QueueState
from otel_kvtrace.whatif.policy import INF, Policy


class ReadyQueue(Policy):
    name = "ready_queue"
    probes_head = True

    def select(self, state: QueueState, now: int) -> list[int] | int:
        q = state.q
        head = state.head()
        if head >= state.n_arrived:
            return INF  # idle until the next arrival
        if state.ready_at(head) <= now:
            return [head]
        waits: list[int] = []
        served = state.served
        step_left = state.step_left
        for j in range(head + 1, state.n_arrived):
            if served[j] or rules.final_must_wait(q.final[j], step_left[q.step[j]]) or not state.determinable(j):
                continue
            r = state.ready_at(j)
            if r <= now:
                return [j]
            waits.append(r + state.sleep_lag(j))
        if not waits or state.waits_on_gate(head, now):
            return [head]  # nothing may pass, or the head waits on the device: it blocks in its own wait
        # the thread sleeps in get() until a wait is met; it runs again that wait's wake-up latency later
        # (a save's set() notifies the queue's condition, as it sets the event a blocked head would wait on)
        head_at = state.ready_at(head) + state.sleep_lag(head)
        return min(head_at, *waits)
