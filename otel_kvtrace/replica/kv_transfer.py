"""Transfer threads shaped like upstream's ``kv_transfer.py`` (research §1, §2.5).

Same class names, method names, attribute names and blocking calls, so the instrumentation written for
vLLM-Ascend attaches unchanged. ``behaviour`` selects ``main`` (M) or ``v0.23`` (R) semantics where the
two differ: exception handling in ``run()``, the order of the save wait, the NPU sync, the slot-release
waiter, and what happens on a failed copy. Written from the research notes, not from upstream code.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from otel_kvtrace.replica.backend import G2L, L2G, FakeMStore, FakeTokenDatabase, encode_addr
from otel_kvtrace.replica.metadata import LayerBatchReqMeta, LayerLoadTask, LayerTransferTask, SharedBlockData

logger = logging.getLogger("otel_kvtrace.replica")


class LayerBatchBuilder:
    """Builds per-layer address metadata. Send and recv threads each own their instances."""

    def __init__(self, token_database: FakeTokenDatabase, page_size_bytes: int, num_layers: int, group_id: int = 0):
        self.token_database = token_database
        self.page_size_bytes = page_size_bytes
        self.num_layers = num_layers
        self.group_id = group_id

    def build_shared(self, task: LayerTransferTask) -> SharedBlockData:
        """Per-step data shared by every layer (runs on the forward thread upstream)."""
        req_ids: list[str] = []
        last: list[bool] = []
        keys: list[str] = []
        blocks: list[int] = []
        for rng in task.block_ranges:
            req_ids.append(rng.request.req_id)
            last.append(rng.request.is_last_chunk)
            for b in range(rng.start_block, rng.end_block):
                keys.append(f"{rng.request.req_id}/b{b}")
                blocks.append(b)
        return SharedBlockData(req_ids, last, keys, blocks, task.step)

    def build_addrs(self, shared: SharedBlockData, layer_idx_in_group: int) -> LayerBatchReqMeta | None:
        """Addresses, sizes and GVAs of one layer (numpy arithmetic upstream; a short loop here)."""
        db = self.token_database
        index = db.spend_meta_build(shared.step, layer_idx_in_group)
        n = len(shared.block_ids_arr)
        if n == 0:
            return None
        size = db.group_block_len[0][0]
        values = [encode_addr(index, b) for b in range(n)]
        return LayerBatchReqMeta(
            layer_idx_in_group, shared.req_ids, shared.is_last_chunks, shared.load_keys,
            addrs=values, sizes=[size] * n, gvas=values,
        )

    def build(self, task: LayerTransferTask, is_save: bool = False) -> LayerBatchReqMeta | None:
        return self.build_addrs(self.build_shared(task), task.layer_idx_in_group)


class KVTransferThread(threading.Thread):
    """Base: an unbounded FIFO served by one daemon thread (research §1.1)."""

    def __init__(
        self,
        m_store: FakeMStore,
        token_database: FakeTokenDatabase,
        block_size: int,
        tp_rank: int,
        tp_size: int,
        dcp_size: int,
        ready_event: threading.Event,
        name: str,
        *,
        behaviour: str = "main",
        wait_timeout_s: float = 10.0,
    ) -> None:
        super().__init__(daemon=True, name=name)
        self.m_store = m_store
        self.token_database = token_database
        self.block_size = block_size
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.dcp_size = dcp_size
        self.ready_event = ready_event
        self.request_queue: queue.Queue = queue.Queue()
        self.behaviour = behaviour
        self.wait_timeout_s = wait_timeout_s
        self.num_addrs_per_block = len(token_database.group_block_len[0])
        self._fatal_error: BaseException | None = None
        self._stopping = False
        self._finished_lock = threading.Lock()
        self.finished_requests: set[str] = set()

    def add_request(self, request: object) -> None:
        self.request_queue.put(request)

    def raise_if_failed(self) -> None:
        """Main only upstream: re-raise the error that killed the thread."""
        if self._fatal_error is not None:
            raise RuntimeError(f"{self.name} failed") from self._fatal_error

    def set_finished_request(self, req_id: str) -> None:
        with self._finished_lock:
            self.finished_requests.add(req_id)

    def stop(self) -> None:
        """Replica shutdown: the next ``None`` item ends the loop (after its ``task_done``)."""
        self._stopping = True
        self.request_queue.put(None)

    def run(self) -> None:
        self.m_store.set_device()
        self.ready_event.set()
        while True:
            item = self.request_queue.get()
            if item is None:
                self.request_queue.task_done()
                if self._stopping:
                    return
                continue
            try:
                self._handle_request(item)
            except Exception as exc:
                if self.behaviour == "main":
                    self._fatal_error = exc
                    logger.error("%s: fatal error, thread stops: %r", self.name, exc)
                    return
                logger.error("%s: error handling request: %r", self.name, exc)
                self._handle_request_exception(item)

    def _handle_request(self, item: Any) -> None:  # pragma: no cover - subclasses implement
        raise NotImplementedError

    def _handle_request_exception(self, item: Any) -> None:
        """v0.23 hook after a failed request: a no-op for the layer threads."""

    def _batch_copy_with_limits(
        self, srcs: list[int], dsts: list[int], sizes: list[int], direction: int,
        max_transfer_blocks: int, max_transfer_bytes: int,
    ) -> int:
        """Chunked ``m_store.store.batch_copy``; returns the first non-zero result code."""
        n = len(sizes)
        chunk = max_transfer_blocks * self.num_addrs_per_block if max_transfer_blocks > 0 else n
        chunk = max(1, chunk)
        result = 0
        for start in range(0, n, chunk):
            end = min(n, start + chunk)
            for a, b in _split_by_bytes(sizes, start, end, max_transfer_bytes):
                res = self.m_store.store.batch_copy(srcs[a:b], dsts[a:b], sizes[a:b], direction)
                if res != 0 and result == 0:
                    result = res
        return result


def _split_by_bytes(sizes: list[int], start: int, end: int, limit: int) -> list[tuple[int, int]]:
    if limit <= 0:
        return [(start, end)]
    out = []
    a = start
    total = 0
    for i in range(start, end):
        if total and total + sizes[i] > limit:
            out.append((a, i))
            a, total = i, 0
        total += sizes[i]
    out.append((a, end))
    return out


class KVCacheStoreLayerRecvingThread(KVTransferThread):
    """GVA path recv thread (research §1.3 main, §1.4 v0.23).

    Replica-only: under the live ``gate_group`` scheduler (``otel_kvtrace.schedule``) the task that got
    its gate copies the queued tasks of the same gate (``request_queue.claim_gate_group``) in the same
    backend call, after each member's own save (and, on main, slot) wait; each member still comes out of
    ``get()`` in FIFO order, where only its load event, lease and ``task_done`` are left to do."""

    kvtrace_merged_copy = True
    """This thread can copy several layers in one backend call (what ``gate_group`` needs live)."""

    def __init__(
        self,
        m_store: FakeMStore,
        token_database: FakeTokenDatabase,
        block_size: int,
        tp_rank: int,
        tp_size: int,
        dcp_size: int,
        page_size_bytes: int,
        ready_event: threading.Event,
        get_event: threading.Event,
        layer_load_finished_events: list[threading.Event],
        layer_save_finished_events: list[threading.Event],
        sync_save_events: list,
        num_layers: int,
        h2d_stagger_us: float = 0,
        max_transfer_blocks: int = 0,
        max_transfer_bytes: int = 0,
        group_builders: list[LayerBatchBuilder] | None = None,
        external_slot_release_waiter: Callable[[int], None] | None = None,
        save_failure_checker: Callable[[], None] | None = None,
        *,
        behaviour: str = "main",
        wait_timeout_s: float = 10.0,
    ) -> None:
        super().__init__(m_store, token_database, block_size, tp_rank, tp_size, dcp_size, ready_event,
                         "KVCacheStoreLayerRecvingThread", behaviour=behaviour, wait_timeout_s=wait_timeout_s)
        self.page_size_bytes = page_size_bytes
        self.get_event = get_event
        self.layer_load_finished_events = layer_load_finished_events
        self.layer_save_finished_events = layer_save_finished_events
        self.sync_save_events = sync_save_events
        self.num_layers = num_layers
        self.final_layer_id = num_layers - 1
        self.h2d_stagger_us = h2d_stagger_us
        self.max_transfer_blocks = max_transfer_blocks
        self.max_transfer_bytes = max_transfer_bytes
        self.group_builders = group_builders or [LayerBatchBuilder(token_database, page_size_bytes, num_layers)]
        self.external_slot_release_waiter = external_slot_release_waiter
        self.save_failure_checker = save_failure_checker
        self._copied: dict[int, tuple[list[str], list[str]]] = {}
        """``gate_group``: members already copied in their head's call -> (keys, last_reqs) to finish."""

    def _handle_request(self, data: LayerLoadTask) -> None:
        if self.behaviour == "main":
            self._handle_main(data)
        else:
            self._handle_v023(data)

    # -- main ----------------------------------------------------------------------------------------
    # kept apart from _handle_v023 on purpose: each mirrors one upstream version's recv path line by line
    def _handle_main(self, data: LayerLoadTask) -> None:
        if self._finish_copied(data):
            return
        src = data.wait_for_save_layer
        transfer_tasks = data.transfer_tasks
        layer_id = data.layer_id
        gate = data.attention_start_gate
        if src is not None:
            self._wait_for_save(src, npu_sync=True)
        if len(transfer_tasks) == 0:
            self._finish_empty(layer_id)
            return
        metas = self._build(transfer_tasks)
        if not metas:
            self._finish_empty(layer_id)
            return
        if gate is not None:
            while not gate.wait(timeout=self.wait_timeout_s):
                pass
        members = self._claim_members(data, metas, npu_sync=True)
        gvas, addrs, sizes, keys, last_reqs = _aggregate(metas)
        self._stagger_h2d_submit(layer_id)
        if self.external_slot_release_waiter is not None:
            self.external_slot_release_waiter(layer_id)
            for member, _own in members:
                self.external_slot_release_waiter(member.layer_id)
        res = self._batch_copy_with_limits(gvas, addrs, sizes, G2L, self.max_transfer_blocks, self.max_transfer_bytes)
        if res != 0:
            raise RuntimeError(f"batch_copy failed for layer {layer_id}: result {res}")
        self._mark_copied(members)
        self._finish_layer(layer_id, keys, last_reqs)
        # main leaves transfer_tasks alone: the list is the worker's
        self.request_queue.task_done()
        self.get_event.set()

    def _finish_empty(self, layer_id: int) -> None:
        if self.behaviour == "main" and self.external_slot_release_waiter is not None:
            self.external_slot_release_waiter(layer_id)
        event = self.layer_load_finished_events[layer_id]
        assert not event.is_set(), f"load event of layer {layer_id} already set"
        event.set()
        self.request_queue.task_done()

    # -- v0.23 ---------------------------------------------------------------------------------------
    def _handle_v023(self, data: LayerLoadTask) -> None:
        if self._finish_copied(data):
            return
        src = data.wait_for_save_layer
        transfer_tasks = data.transfer_tasks
        layer_id = data.layer_id
        gate = data.attention_start_gate
        if len(transfer_tasks) == 0:
            if src is not None:
                self._wait_for_save(src, npu_sync=False)
            self.layer_load_finished_events[layer_id].set()
            self.request_queue.task_done()
            return
        metas = self._build(transfer_tasks)
        if not metas:
            self.layer_load_finished_events[layer_id].set()
            self.request_queue.task_done()
            return
        if src is not None:
            self._wait_for_save(src, npu_sync=False)
        if gate is not None:
            while not gate.wait(timeout=self.wait_timeout_s):
                pass
        members = self._claim_members(data, metas, npu_sync=False)
        gvas, addrs, sizes, keys, last_reqs = _aggregate(metas)
        self._stagger_h2d_submit(layer_id)
        res = self._batch_copy_with_limits(gvas, addrs, sizes, G2L, self.max_transfer_blocks, self.max_transfer_bytes)
        if res != 0:
            logger.error("batch_copy failed for layer %d: result %d", layer_id, res)
        self._mark_copied(members)
        self._finish_layer(layer_id, keys, last_reqs)
        transfer_tasks.clear()
        self.request_queue.task_done()
        self.get_event.set()

    # -- gate_group (replica-only: the merged backend call) ---------------------------------------------
    def _claim_members(self, data: LayerLoadTask, metas: list[LayerBatchReqMeta], *,
                       npu_sync: bool) -> list[tuple[LayerLoadTask, list[LayerBatchReqMeta]]]:
        """The queued tasks of ``data``'s gate that join its copy, each after its own save wait; their
        metas are appended to ``metas`` (one backend call). [] unless the queue runs ``gate_group``."""
        claim = getattr(self.request_queue, "claim_gate_group", None)
        if claim is None:
            return []
        members = []
        for member in claim(data):
            own = self._build(member.transfer_tasks) if member.transfer_tasks else []
            if not own:  # nothing to copy: it and those behind it take their own FIFO pass
                break
            if member.wait_for_save_layer is not None:
                self._wait_for_save(member.wait_for_save_layer, npu_sync=npu_sync)
            metas.extend(own)
            members.append((member, own))
        return members

    def _mark_copied(self, members: list[tuple[LayerLoadTask, list[LayerBatchReqMeta]]]) -> None:
        for member, own in members:
            _, _, _, keys, last_reqs = _aggregate(own)
            self._copied[id(member)] = (keys, last_reqs)

    def _finish_copied(self, data: LayerLoadTask) -> bool:
        """A member copied in its head's call: set its load event (lease on the final layer cannot
        happen: the final layer never joins), ``task_done``. False for any other task."""
        done = self._copied.pop(id(data), None) if self._copied else None
        if done is None:
            return False
        self._finish_layer(data.layer_id, *done)
        if self.behaviour != "main":
            data.transfer_tasks.clear()  # v0.23 clears the list after its copy
        self.request_queue.task_done()
        self.get_event.set()
        return True

    # -- shared steps --------------------------------------------------------------------------------
    def _wait_for_save(self, src: int, *, npu_sync: bool) -> None:
        event = self.layer_save_finished_events[src]
        while not event.wait(timeout=self.wait_timeout_s):
            if npu_sync and self.save_failure_checker is not None:
                self.save_failure_checker()
        if npu_sync:
            if self.save_failure_checker is not None:
                self.save_failure_checker()
            self.sync_save_events[src].synchronize()
        event.clear()

    def _build(self, transfer_tasks: list[LayerTransferTask]) -> list[LayerBatchReqMeta]:
        metas = []
        for task in transfer_tasks:
            builder = self.group_builders[task.group_id]
            if task.shared_block_data is not None:
                meta = builder.build_addrs(task.shared_block_data, task.layer_idx_in_group)
            else:
                meta = builder.build(task, is_save=False)
            if meta is not None:
                metas.append(meta)
        return metas

    def _stagger_h2d_submit(self, layer_id: int) -> None:
        """Busy-wait so TP ranks do not start their H2D copies at once (holds the GIL, as upstream)."""
        delay_us = ((self.tp_rank + layer_id) % max(1, self.tp_size)) * self.h2d_stagger_us
        if delay_us <= 0:
            return
        end = time.perf_counter() + delay_us / 1e6
        while time.perf_counter() < end:
            pass

    def _finish_layer(self, layer_id: int, keys: list[str], last_reqs: list[str]) -> None:
        if layer_id == self.final_layer_id:
            if keys:
                self.m_store.batch_remove_lease(sorted(set(keys)))
            for req in last_reqs:
                self.set_finished_request(req)
        event = self.layer_load_finished_events[layer_id]
        if self.behaviour == "main":
            assert not event.is_set(), f"load event of layer {layer_id} already set"
        event.set()


def _aggregate(metas: list[LayerBatchReqMeta]) -> tuple[list[int], list[int], list[int], list[str], list[str]]:
    gvas: list[int] = []
    addrs: list[int] = []
    sizes: list[int] = []
    keys: list[str] = []
    last: list[str] = []
    for meta in metas:
        gvas.extend(meta.gvas)
        addrs.extend(meta.addrs)
        sizes.extend(meta.sizes)
        keys.extend(meta.load_keys)
        last.extend(r for r, is_last in zip(meta.req_ids, meta.is_last_chunks, strict=False) if is_last)
    return gvas, addrs, sizes, keys, sorted(set(last))


class KVCacheStoreKeyLayerRecvingThread(KVTransferThread):
    """Key path recv thread (research §1.5): save wait, gate, key build, synchronous ``m_store.get``."""

    # like the GVA thread's on purpose: upstream's positional signature and attribute names, class by class
    def __init__(
        self,
        m_store: FakeMStore,
        token_database: FakeTokenDatabase,
        block_size: int,
        tp_rank: int,
        tp_size: int,
        dcp_size: int,
        ready_event: threading.Event,
        get_event: threading.Event,
        layer_load_finished_events: list[threading.Event],
        layer_save_finished_events: list[threading.Event],
        num_layers: int,
        *,
        behaviour: str = "main",
        wait_timeout_s: float = 10.0,
    ) -> None:
        super().__init__(m_store, token_database, block_size, tp_rank, tp_size, dcp_size, ready_event,
                         "KVCacheStoreKeyLayerRecvingThread", behaviour=behaviour, wait_timeout_s=wait_timeout_s)
        self.get_event = get_event
        self.layer_load_finished_events = layer_load_finished_events
        self.layer_save_finished_events = layer_save_finished_events
        self.num_layers = num_layers
        self.final_layer_id = num_layers - 1

    def _wait_for_save(self, src: int) -> None:
        event = self.layer_save_finished_events[src]
        while not event.wait(timeout=self.wait_timeout_s):
            pass
        event.clear()

    def _handle_request(self, data: LayerLoadTask) -> None:
        if data.wait_for_save_layer is not None:
            self._wait_for_save(data.wait_for_save_layer)
        gate = data.attention_start_gate
        if gate is not None:
            while not gate.wait(timeout=self.wait_timeout_s):
                pass
        if len(data.transfer_tasks) > 1:
            raise ValueError("key path expects at most one transfer task per layer")
        layer_id = data.layer_id
        keys: list[str] = []
        addrs: list[int] = []
        sizes: list[int] = []
        last: list[str] = []
        for task in data.transfer_tasks:
            index = self.token_database.spend_meta_build(task.step, layer_id)
            block = 0
            for rng in task.block_ranges:
                for b in range(rng.start_block, rng.end_block):
                    keys.append(f"{rng.request.req_id}/b{b}@{layer_id}")
                    addrs.append(encode_addr(index, block))
                    sizes.append(self.token_database.block_bytes)
                    block += 1
                if rng.request.is_last_chunk:
                    last.append(rng.request.req_id)
        if keys:
            shift = self.tp_rank * len(keys) // self.tp_size
            keys = keys[shift:] + keys[:shift]
            addrs = addrs[shift:] + addrs[:shift]
            sizes = sizes[shift:] + sizes[:shift]
            res = self.m_store.get(keys, addrs, sizes)
            if res != 0:
                logger.error("key path get failed for layer %d: result %d", layer_id, res)
        if layer_id == self.final_layer_id:
            for req in sorted(set(last)):
                self.set_finished_request(req)
        self.layer_load_finished_events[layer_id].set()
        data.transfer_tasks.clear()
        self.request_queue.task_done()
        self.get_event.set()


class KVCacheStoreLayerSendingThread(KVTransferThread):
    """GVA path send thread (research §2.5): NPU sync on the save event, batch copy, set save done."""

    def __init__(
        self,
        m_store: FakeMStore,
        token_database: FakeTokenDatabase,
        block_size: int,
        tp_rank: int,
        tp_size: int,
        dcp_size: int,
        page_size_bytes: int,
        ready_event: threading.Event,
        layer_save_finished_events: list[threading.Event],
        sync_save_events: list,
        num_layers: int,
        max_transfer_blocks: int = 0,
        max_transfer_bytes: int = 0,
        group_builders: list[LayerBatchBuilder] | None = None,
        *,
        behaviour: str = "main",
        wait_timeout_s: float = 10.0,
        name: str = "KVCacheStoreLayerSendingThread",
    ) -> None:
        super().__init__(m_store, token_database, block_size, tp_rank, tp_size, dcp_size, ready_event, name,
                         behaviour=behaviour, wait_timeout_s=wait_timeout_s)
        self.page_size_bytes = page_size_bytes
        self.layer_save_finished_events = layer_save_finished_events
        self.sync_save_events = sync_save_events
        self.num_layers = num_layers
        self.final_layer_id = num_layers - 1
        self.max_transfer_blocks = max_transfer_blocks
        self.max_transfer_bytes = max_transfer_bytes
        self.group_builders = group_builders or [LayerBatchBuilder(token_database, page_size_bytes, num_layers)]

    def _handle_request(self, tasks: list[LayerTransferTask]) -> None:
        layer_id = tasks[0].layer_id
        metas = []
        for task in tasks:
            if task.shared_block_data is None:
                continue
            meta = self.group_builders[task.group_id].build_addrs(task.shared_block_data, task.layer_idx_in_group)
            if meta is not None:
                metas.append(meta)
        if metas:
            self.sync_save_events[layer_id].synchronize()
            gvas, addrs, sizes, keys, _ = _aggregate(metas)
            res = self._save(keys, gvas, addrs, sizes)
            if res != 0:
                if self.behaviour == "main":
                    raise RuntimeError(f"save copy failed for layer {layer_id}: result {res}")
                logger.error("save copy failed for layer %d: result %d", layer_id, res)
            if self.behaviour == "main" or layer_id == self.final_layer_id:
                self.m_store.batch_write_finish(keys)
        self.layer_save_finished_events[layer_id].set()
        self.request_queue.task_done()

    def _save(self, keys: list[str], gvas: list[int], addrs: list[int], sizes: list[int]) -> int:
        return self._batch_copy_with_limits(addrs, gvas, sizes, L2G, self.max_transfer_blocks, self.max_transfer_bytes)


class KVCacheStoreKeyLayerSendingThread(KVCacheStoreLayerSendingThread):
    """Key path send thread: NPU sync, ``m_store.put``, set save done."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("name", "KVCacheStoreKeyLayerSendingThread")
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def _save(self, keys: list[str], gvas: list[int], addrs: list[int], sizes: list[int]) -> int:
        return self.m_store.put(keys, addrs, sizes)
