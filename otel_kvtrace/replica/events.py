"""The virtual engine's event loop: one heap keyed by ``(time, seq)``, signals, generator actors.

A signal is an index into one flat ``times`` list (``-1`` until fired). An actor is a generator that yields
the signal it waits for and receives the time the signal fired. A wait on a signal that already fired
costs no event; a wait on an unfired one parks the actor until ``fire`` pushes its resume on the heap.
``seq`` breaks ties in push order, so equal-time resumes run in the order they became runnable.
"""

from __future__ import annotations

import heapq
from collections.abc import Generator
from typing import Any


class EventLoop:
    """Heap of ``(time, seq, actor, value)`` with ``seq`` breaking ties in push order, plus signals.

    A signal is an index into one flat ``times`` list (``-1`` until fired). An actor is a generator that
    yields the signal index it waits for and receives the signal's fire time. Each actor keeps its own
    clock (``max`` of its previous time and the times it waited for), so results depend only on signal
    times, never on the order the heap hands out resumes; the heap time is a lower bound of the actor's.
    """

    __slots__ = ("events", "heap", "seq", "times", "waiters")

    def __init__(self, num_signals: int) -> None:
        self.heap: list[tuple[int, int, Actor, int | None]] = []
        self.seq = 0
        self.events = 0
        self.times = [-1] * num_signals
        self.waiters: dict[int, Actor] = {}

    def fire(self, sig: int, t: int) -> None:
        """Fire ``sig`` at ``t`` and schedule the actor waiting on it (at most one per signal)."""
        self.times[sig] = t
        actor = self.waiters.pop(sig, None)
        if actor is not None:
            self.seq += 1
            heapq.heappush(self.heap, (max(actor.blocked_at, t), self.seq, actor, t))

    def start(self, actor: Actor) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (0, self.seq, actor, None))

    def run(self) -> None:
        heap = self.heap
        times = self.times
        waiters = self.waiters
        while heap:
            when, _, actor, value = heapq.heappop(heap)
            self.events += 1
            gen = actor.gen
            try:
                while True:
                    sig = gen.send(value)
                    value = times[sig]
                    if value < 0:  # not known yet: park until it fires
                        actor.blocked_at = when
                        waiters[sig] = actor
                        break
            except StopIteration:
                actor.done = True


class Actor:
    """One simulated thread: a generator and the time it last parked at."""

    __slots__ = ("blocked_at", "done", "gen", "name")

    def __init__(self, name: str, gen: Generator[int, Any, None]) -> None:
        self.name = name
        self.gen = gen
        self.blocked_at = 0
        self.done = False
