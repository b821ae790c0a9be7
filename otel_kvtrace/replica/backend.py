"""Fake MemCache backend (``m_store``) and token database for the threaded replica.

Copy calls take the time the work plan says, occupy a fake-NPU copy stream and block the caller, like
MemCache's synchronous ``batch_copy``. The (step, layer) a copy belongs to travels inside the GVA /
address values (``encode_addr``), so the backend needs no side channel from the threads.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from otel_kvtrace.replica.fake_npu import FakeNPU
from otel_kvtrace.replica.plan import WorkPlan

G2L = 1
"""``batch_copy`` direction of a load (global pool -> local HBM)."""
L2G = 0
"""``batch_copy`` direction of a save."""
_INDEX_SHIFT = 24


def encode_addr(index: int, block: int) -> int:
    """An address/GVA value carrying the plan index ``step * num_layers + layer`` and a block number."""
    return (index << _INDEX_SHIFT) | block


def decode_index(value: int) -> int:
    return value >> _INDEX_SHIFT


@dataclass
class FakeTokenDatabase:
    """The few token-database fields the transfer threads read, plus the replica's plan and device."""

    plan: WorkPlan
    npu: FakeNPU
    block_bytes: int = 4096
    group_block_len: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.group_block_len:
            self.group_block_len = [[self.block_bytes]]

    def planned_meta_build(self, step: int, layer: int) -> tuple[int, int]:
        """(the plan index ``step * num_layers + layer`` the addresses encode, the planned build ns)."""
        index = step * self.plan.num_layers + layer
        return index, self.plan.meta_build[index]

    def spend_meta_build(self, step: int, layer: int) -> int:
        """Block the caller for the planned address-build time of (step, layer), as upstream's numpy work
        would; returns the plan index the addresses encode."""
        index, cost = self.planned_meta_build(step, layer)
        if cost:
            clock = self.npu.clock
            clock.sleep_until(clock.now_ns() + cost)
        return index


class FakeStoreClient:
    """The raw client behind ``m_store.store``: ``batch_copy(srcs, dsts, sizes, direction) -> int``."""

    def __init__(self, plan: WorkPlan, npu: FakeNPU) -> None:
        self._plan = plan
        self._npu = npu
        self._h2d = npu.stream("h2d")
        self._d2h = npu.stream("d2h")
        self.pending_copies = [0, 0]
        """Calls inside ``batch_copy`` per direction (index ``L2G``/``G2L``); one writer each (send/recv thread)."""

    def batch_copy(self, srcs: list[int], dsts: list[int], sizes: list[int], direction: int) -> int:
        """Copy ``len(sizes)`` blocks; blocks the caller for the planned time. 0 = success."""
        if not sizes:
            return 0
        plan = self._plan
        gva = srcs[0] if direction == G2L else dsts[0]
        index = decode_index(gva)
        if direction == G2L:
            blocks, table = max(1, plan.load_blocks[index]), plan.load_copy
        else:
            blocks, table = max(1, plan.blocks[index // plan.num_layers]), plan.save_copy
        duration = table[index] * len(sizes) // blocks
        stream = self._h2d if direction == G2L else self._d2h
        self.pending_copies[direction] += 1
        end = stream.launch(("load" if direction == G2L else "save", index), duration)
        self._npu.clock.sleep_until(end)
        self.pending_copies[direction] -= 1
        if direction == G2L and index == plan.fail_index:
            return 1
        return 0


class FakeMStore:
    """``m_store``: the backend object the threads and the worker call."""

    def __init__(self, plan: WorkPlan, npu: FakeNPU, lease_release_ns: int = 50_000) -> None:
        self.store = FakeStoreClient(plan, npu)
        self._plan = plan
        self._npu = npu
        self._lease_ns = lease_release_ns
        self._lock = threading.Lock()
        self.lease_releases: list[tuple[int, int]] = []
        """``(clock ns at return, number of keys)`` per ``batch_remove_lease`` call."""

    def set_device(self) -> None:
        """``torch.npu.set_device`` stand-in: nothing to do on a fake device."""

    def batch_remove_lease(self, keys: list[str]) -> None:
        clock = self._npu.clock
        clock.sleep_until(clock.now_ns() + self._lease_ns)
        with self._lock:
            self.lease_releases.append((clock.now_ns(), len(keys)))

    def get(self, keys: list[str], addrs: list[int], sizes: list[int]) -> int:
        """Key path load (``batch_get_into_layers``); blocking, planned time."""
        return self.store.batch_copy(addrs, addrs, sizes, G2L)

    def put(self, keys: list[str], addrs: list[int], sizes: list[int]) -> int:
        """Key path save; blocking, planned time."""
        return self.store.batch_copy(addrs, addrs, sizes, L2G)

    def batch_write_finish(self, keys: list[str]) -> None:
        """Publishing saved blocks: instantaneous here."""
