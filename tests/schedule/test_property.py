"""Property test: the live scheduler over random dependency graphs with a producer that follows the
forward's order (a save or a gate of layer c only happens after the loads up to c completed)."""

from __future__ import annotations

import queue

from hypothesis import given, settings
from hypothesis import strategies as st

from otel_kvtrace.schedule.queue import READY, SchedulingQueue, hook_save_signals, probe

from .fakes import FakeGate, FakeThread, Task


@st.composite
def graphs(draw: st.DrawFn) -> list[tuple[int | None, int | None]]:
    """Per layer of one step: (save source layer, gate layer) or None for each; both before the layer."""
    n = draw(st.integers(2, 9))
    out = []
    for layer in range(n):
        src = draw(st.none() | st.integers(0, layer - 1)) if layer else None
        gate = draw(st.none() | st.integers(0, layer - 1)) if layer else None
        out.append((src, gate))
    return out


@settings(max_examples=150, deadline=None)
@given(graph=graphs(), data=st.data())
def test_every_task_once_constraints_hold_no_deadlock_fifo_unless_ready(graph: list, data: st.DataObject) -> None:
    n = len(graph)
    thread = FakeThread(num_layers=n)
    q = SchedulingQueue(thread, "ready_queue")
    hook_save_signals(q, thread.layer_save_finished_events)
    for ev in thread.sync_save_events:
        ev.done = False
    for c in data.draw(st.sets(st.integers(0, n - 1), max_size=2)):  # stale save events of a previous step
        thread.layer_save_finished_events[c].set()
        thread.sync_save_events[c].done = True
    gates = {c: FakeGate() for c in range(n)}
    tasks = [Task(layer, src, gates[g] if g is not None else None) for layer, (src, g) in enumerate(graph)]
    for t in tasks:
        q.put(t)
    served: list[int] = []
    pending_fire: set[tuple[str, int]] = set()
    stalled = False

    def loads_done_upto(c: int) -> bool:
        return all(layer in served for layer in range(c + 1))

    for _ in range(20 * n + 20):
        if len(served) == n:
            break
        # what the producers could do now, in the forward's order
        fire = []
        for layer, (src, g) in enumerate(graph):
            if src is not None and loads_done_upto(src):
                if not thread.layer_save_finished_events[src].is_set():
                    fire.append(("save", src))
                elif not thread.sync_save_events[src].done:
                    fire.append(("npu", src))
            if g is not None and loads_done_upto(g):
                if gates[g]._event is None:
                    fire.append(("gate", g))
                elif not gates[g]._event.done:
                    fire.append(("gate_npu", g))
        fire = sorted(set(fire))
        if fire and (stalled or data.draw(st.booleans())):
            kind, c = data.draw(st.sampled_from(fire))
            stalled = False
            if kind == "save":
                thread.layer_save_finished_events[c].set()
            elif kind == "npu":
                thread.sync_save_events[c].done = True
            elif kind == "gate":
                gates[c].record(done=False)
            else:
                gates[c]._event.done = True  # type: ignore[union-attr]
            pending_fire.add((kind, c))
            continue
        head = next(t for t in tasks if t.layer_id not in served)
        head_ready = probe(thread, head, 0)[0] == READY
        try:
            got = q.try_get()
        except queue.Empty:
            assert not fire or not head_ready, "nothing handed out although the head is ready"
            if not fire:
                raise AssertionError(f"deadlock: served {served}, nothing left to fire") from None
            stalled = True  # nothing can go: a producer acts next
            continue
        layer = got.layer_id
        assert layer not in served  # every task once
        src, g = graph[layer]
        if got is not head:
            assert not head_ready  # FIFO wherever the head is ready
            assert layer != n - 1  # the final layer never passes
        # hard constraints at the moment it was handed out: its waits are met or it is the head
        if got is not head:
            assert src is None or (thread.layer_save_finished_events[src].is_set()
                                   and thread.sync_save_events[src].done)
            assert g is None or (gates[g]._event is not None and gates[g]._event.done)
            assert src is None or loads_done_upto(src)  # buffer chain: never before its owner's load
        served.append(layer)
        if src is not None and got is head and not thread.layer_save_finished_events[src].is_set():
            # upstream would block in the head: play the producers until its waits are met
            thread.layer_save_finished_events[src].set()
        if src is not None:
            thread.sync_save_events[src].done = True
            thread.layer_save_finished_events[src].clear()  # the recv thread consumes the save event
        if g is not None and gates[g]._event is None:
            gates[g].record(done=True)
    assert sorted(served) == list(range(n))
    assert served[-1] == n - 1
    assert all(ev.syncs == 0 for ev in thread.sync_save_events)  # the scheduler never synchronizes
