"""``fifo``: upstream behaviour. Serve in enqueue order; a waiting head blocks everything behind it."""

from __future__ import annotations

from otel_kvtrace.whatif.engine import QueueState
from otel_kvtrace.whatif.policy import INF, Policy


class Fifo(Policy):
    name = "fifo"

    def select(self, state: QueueState, now: int) -> list[int] | int:
        head = state.head()
        if head >= state.n_arrived:
            return INF  # idle until the next arrival
        return [head]
