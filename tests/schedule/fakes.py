"""Fake producer-side objects for the live scheduler: controllable CPU/NPU events, gates, a thread."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any


class FakeNpuEvent:
    """``torch.npu.Event`` whose completion the test decides; counts ``synchronize()`` calls."""

    def __init__(self, done: bool = True) -> None:
        self.done = done
        self.queries = 0
        self.syncs = 0

    def query(self) -> bool:
        self.queries += 1
        return self.done

    def synchronize(self) -> None:
        self.syncs += 1


class FakeGate:
    """``AttentionComputeStartGate``'s recorded state: ``_event`` is None until ``record``."""

    def __init__(self) -> None:
        self._event: FakeNpuEvent | None = None

    def record(self, done: bool = True) -> None:
        self._event = FakeNpuEvent(done)


@dataclass
class Task:
    """A ``LayerLoadTask`` look-alike (the fields the scheduler reads)."""

    layer_id: int
    wait_for_save_layer: int | None = None
    attention_start_gate: Any = None
    transfer_tasks: list[Any] = field(default_factory=list)


class FakeThread:
    """The recv-thread attributes the scheduler reads."""

    def __init__(self, num_layers: int = 8, slot_times: dict[int, int] | None = None) -> None:
        self.final_layer_id = num_layers - 1
        self.layer_save_finished_events = [threading.Event() for _ in range(num_layers)]
        self.sync_save_events = [FakeNpuEvent(True) for _ in range(num_layers)]
        self.external_slot_release_waiter = None
        if slot_times is not None:
            self.external_slot_release_waiter = SlotWaiter(slot_times)
        self.ident = None


class SlotWaiter:
    def __init__(self, times: dict[int, int]) -> None:
        self.times = times

    def __call__(self, layer_id: int) -> None:  # pragma: no cover - the scheduler never calls it
        raise AssertionError("the scheduler must not block in the slot waiter")

    def kvtrace_release_time(self, layer_id: int) -> int:
        return self.times.get(layer_id, 0)
