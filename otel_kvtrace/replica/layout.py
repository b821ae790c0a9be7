"""Layer layout and submission rules shared by both replica engines (research §2.2, §2.4).

Everything here is a pure function of the configuration, so the threaded replica and the virtual-clock
engine cannot disagree on which layer reuses which buffer, which tasks a ``wait_for_layer_load`` enqueues,
or which attention gate each task gets.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from otel_kvtrace.replica.config import ReplicaConfig


@dataclass(slots=True, frozen=True)
class ReuseLayout:
    """Buffer owner chains: ``buffer_slots[i]`` lists the layers sharing one physical buffer, in order."""

    buffer_slots: tuple[tuple[int, ...], ...]
    prefetch_layer_map: dict[int, int]
    """``layer -> layer whose save must finish before this layer's load may overwrite the buffer``."""
    has_layer_reuse: bool

    def storage_index(self, layer: int) -> int:
        """Index of the buffer slot holding ``layer``."""
        for i, slot in enumerate(self.buffer_slots):
            if layer in slot:
                return i
        raise KeyError(layer)


def build_layout(cfg: ReplicaConfig) -> ReuseLayout:
    """The reuse layout for ``cfg``: none on ``v0.23``, on the key path or with reuse off.

    Single bucket (research §2.2 simple layout): reused layers are the non-independent ones, slot ``s`` of
    ``B`` holds ``reused[s::B]``. Multi-bucket: non-independent layers are grouped by kind
    (``bucket_pattern``); each bucket gets ``min(B, len(bucket))`` slots laid out the same way. In both, a
    layer's source is its predecessor in its slot.
    """
    n = cfg.num_layers
    independent = set(cfg.resolved_independent)
    if not cfg.reuse_enabled:
        return ReuseLayout(tuple((layer,) for layer in range(n)), {}, False)
    reused = [layer for layer in range(n) if layer not in independent]
    buckets: dict[str, list[int]] = {}
    pattern = cfg.bucket_pattern or "a"
    for layer in reused:
        buckets.setdefault(pattern[layer % len(pattern)], []).append(layer)
    b = cfg.resolved_buffers
    slots: list[tuple[int, ...]] = [(layer,) for layer in sorted(independent)]
    mapping: dict[int, int] = {}
    has_reuse = False
    for kind in sorted(buckets):
        members = buckets[kind]
        nb = min(b, len(members))
        if len(members) > nb:
            has_reuse = True
        for s in range(nb):
            chain = tuple(members[s::nb])
            slots.append(chain)
            for prev, nxt in itertools.pairwise(chain):
                mapping[nxt] = prev
    return ReuseLayout(tuple(slots), dict(sorted(mapping.items())), has_reuse)


@dataclass(slots=True, frozen=True)
class Submission:
    """One ``LayerLoadTask`` enqueued by ``wait_for_layer_load(current_layer)``."""

    layer_id: int
    wait_for_save_layer: int | None
    gate_layer: int | None
    """Forward layer whose gate the task waits on (the ``c`` of ``G_c``), or ``None``."""
    has_transfer: bool


def submit_count(current_layer: int, prefetch_layers: int) -> int:
    """How many tasks ``wait_for_layer_load(current_layer)`` submits: ``P`` at layer 0, then 1."""
    return prefetch_layers if current_layer == 0 else 1


def plan_submission(
    layer: int, current_layer: int, has_transfer: bool, prefetch_layer_map: dict[int, int], behaviour: str
) -> Submission | None:
    """The task for ``layer`` if it is submittable, else ``None`` (skipped, not counted).

    Submittable iff it has a transfer or (``main``) a reuse source. The gate is ``G_current_layer`` iff the
    layer is not the current one and (``main``) it has a transfer, so empty reuse tasks never get a gate.
    """
    main = behaviour == "main"
    src = prefetch_layer_map.get(layer) if main else None
    if not has_transfer and src is None:
        return None
    if layer == current_layer or (main and not has_transfer):
        gate = None
    else:
        gate = current_layer
    return Submission(layer, src, gate, has_transfer)


class SubmitWindow:
    """The prefetch window of one step: which tasks each ``wait_for_layer_load(c)`` enqueues.

    Mirrors upstream's ``_submit_ready_layer_loads`` (research §2.4) through ``submit_count`` and
    ``plan_submission``, which the threaded ``KVPoolWorker`` calls too.
    """

    __slots__ = ("_behaviour", "_has_transfer", "_map", "_n", "_p", "next_layer_to_submit")

    def __init__(
        self,
        num_layers: int,
        prefetch_layers: int,
        prefetch_layer_map: dict[int, int],
        behaviour: str,
        has_transfer: Callable[[int], bool],
    ) -> None:
        self._n = num_layers
        self._p = prefetch_layers
        self._map = prefetch_layer_map
        self._behaviour = behaviour
        self._has_transfer = has_transfer
        self.next_layer_to_submit = 0

    def submit(self, current_layer: int) -> list[Submission]:
        """Advance the window for ``wait_for_layer_load(current_layer)``."""
        out: list[Submission] = []
        count = submit_count(current_layer, self._p)
        while len(out) < count and self.next_layer_to_submit < self._n:
            layer = self.next_layer_to_submit
            self.next_layer_to_submit += 1
            sub = plan_submission(layer, current_layer, self._has_transfer(layer), self._map, self._behaviour)
            if sub is not None:
                out.append(sub)
        return out


def enqueue_plan(
    cfg: ReplicaConfig, has_transfer: Callable[[int], bool] | None = None, layout: ReuseLayout | None = None
) -> list[list[Submission]]:
    """Per forward layer ``c``, the submissions its ``wait_for_layer_load`` makes in one step."""
    layout = layout if layout is not None else build_layout(cfg)
    window = SubmitWindow(
        cfg.num_layers,
        cfg.resolved_prefetch,
        layout.prefetch_layer_map,
        cfg.behaviour,
        has_transfer if has_transfer is not None else (lambda layer: cfg.requests_per_step > 0),
    )
    return [window.submit(c) for c in range(cfg.num_layers)]


def should_wait(cfg: ReplicaConfig, layout: ReuseLayout, layer: int, has_transfer: bool) -> bool:
    """Whether the forward blocks on ``layer``'s load event (research §2.4)."""
    if cfg.behaviour == "main":
        return has_transfer or layer in layout.prefetch_layer_map
    return has_transfer
