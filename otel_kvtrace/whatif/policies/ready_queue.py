"""``ready_queue``: dependency-aware and cooperative. At a dependency wait whose time has not come, the
recv thread sets the task aside (keeping its progress) and runs the lowest-seq task that can make
progress now; a bypass-ready task may therefore go before a waiting head.

Hard constraints kept: a task passes its save (H1), gate (attention boundary) and external slot (H2)
waits only once they are met, with save and gate times the engine moves behind the forward's replayed
progress, so slot-chain successors never pass their predecessor; the step's final-layer task (lease
release, H3) does not start until it is the last unserved task of its step. Only work before a wait
(metadata build, stagger) runs early; the copy always comes after every wait. When nothing can make
progress the thread sleeps until the first dependency or arrival (online: it polls the events, it does
not predict them).
"""

from __future__ import annotations

import heapq

from otel_kvtrace.schedule import rules
from otel_kvtrace.whatif.engine import QueueState
from otel_kvtrace.whatif.policy import Policy


class ReadyQueue(Policy):
    name = "ready_queue"
    uses_ready_index = True

    def select(self, state: QueueState, now: int) -> tuple[int] | int:
        state.refresh(now)
        ready = state.ready
        served = state.served
        q = state.q
        while ready:
            i = heapq.heappop(ready)
            if served[i]:
                continue
            if state.phase[i] == 0 and rules.final_must_wait(q.final[i], state.step_left[q.step[i]]):
                state.hold_final(i)
                continue
            return (i,)
        return state.next_ready_time()
