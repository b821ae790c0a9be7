"""The live ``ready_queue``'s own cost per dequeue, sized from the FIFO recording alone.

Each ``get()`` of the live ``ready_queue`` with more than one task queued probes the head's waits before it
hands the head out (:func:`otel_kvtrace.schedule.queue.probe`: the save event's ``is_set()``, the save NPU
event's and the gate's ``query()``, the slot release time). FIFO's ``get()`` checks nothing; the head's own
waits then make the same checks. So the decision costs the recv thread, on every such dequeue, about what
those checks cost where they find the dependency met, and a FIFO recording times exactly that in situ: a
wait that returned without blocking (``ReplayTask.check_ns``). The engine charges it when another task is
queued (``QueueState.decision_cost``). Without it the prediction charged 0, and the live ``ready_queue``
was 15-23 us later than FIFO on every layer it did not reorder (docs/whatif.md, "Replay model", "A
policy's own cost per dequeue").

The estimate: per wait kind, the median duration of the recorded waits of that kind that did not block;
per task, the sum over the wait kinds it has; the median over the queue's tasks. The rest of the
decision (the lock released around the probe, the bookkeeping of the pop) is not in it, so it is a lower
bound of the live ``get()``'s extra CPU (``bench/scheduler_cost.py`` measures that one live).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from otel_kvtrace.whatif.task import WAIT_KINDS, ReplayTask


def check_medians(tasks: Sequence[ReplayTask]) -> list[int | None]:
    """Per wait kind (save, gate, slot): the median recorded duration of a wait that did not block, or
    None when the recording has no such wait."""
    out: list[int | None] = []
    for kind in range(len(WAIT_KINDS)):
        samples = [c for t in tasks if (c := t.check_ns[kind]) is not None and c >= 0]
        out.append(int(statistics.median(samples)) if samples else None)
    return out


def decision_cost_ns(tasks: Sequence[ReplayTask]) -> int:
    """The live ``ready_queue``'s cost per dequeue above FIFO's for one queue (see the module docstring);
    0 when no wait of the recording returned without blocking."""
    medians = check_medians(tasks)
    per_task = [sum(m for kind, m in enumerate(medians) if m is not None and t.check_ns[kind] is not None)
                for t in tasks]
    return int(statistics.median(per_task)) if per_task else 0
