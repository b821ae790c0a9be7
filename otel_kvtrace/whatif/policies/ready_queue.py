"""``ready_queue``: serve the lowest-seq task whose dependencies are all met now (a bypass-ready task
may go before a waiting head).

Hard constraints kept: a task is only served once its save (H1), gate (attention boundary) and external
slot (H2) are ready, which the engine computes behind the forward's replayed progress, so slot-chain
successors never pass their predecessor; the step's final-layer task (lease release, H3) is held until
it is the last unserved task of its step. When nothing is ready the thread sleeps until the first
readiness or arrival: it never commits to a task that would block (an online rule: it only needs to
poll the events, not to predict them).
"""

from __future__ import annotations

import heapq

from otel_kvtrace.whatif.engine import QueueState
from otel_kvtrace.whatif.policy import Policy


class ReadyQueue(Policy):
    name = "ready_queue"
    uses_ready_index = True

    def select(self, state: QueueState, now: int) -> list[int] | int:
        state.refresh(now)
        ready = state.ready
        served = state.served
        q = state.q
        while ready:
            i = heapq.heappop(ready)
            if served[i]:
                continue
            if q.final[i] and state.step_left[q.step[i]] > 1:
                state.hold_final(i)
                continue
            return [i]
        return state.next_ready_time()
