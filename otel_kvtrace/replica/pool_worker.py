"""``KVPoolWorker`` of the replica: the producer side (research §2), same names as upstream.

The forward thread calls ``start_load_kv`` once per step, then per layer ``wait_for_layer_load`` (before
attention) and ``save_kv_layer`` (after attention). ``current_layer`` only advances in ``save_kv_layer``.
Which tasks are enqueued, with which source layer and gate, comes from ``layout`` (shared with the
virtual engine).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from otel_kvtrace.replica import gate as gate_module
from otel_kvtrace.replica.backend import FakeMStore, FakeTokenDatabase
from otel_kvtrace.replica.config import ReplicaConfig
from otel_kvtrace.replica.fake_npu import FakeNPU
from otel_kvtrace.replica.kv_transfer import (
    KVCacheStoreKeyLayerRecvingThread,
    KVCacheStoreKeyLayerSendingThread,
    KVCacheStoreLayerRecvingThread,
    KVCacheStoreLayerSendingThread,
    KVTransferThread,
    LayerBatchBuilder,
)
from otel_kvtrace.replica.layout import build_layout, plan_submission, should_wait, submit_count
from otel_kvtrace.replica.metadata import LayerLoadTask, LayerTransferTask, SharedBlockData
from otel_kvtrace.replica.plan import PlannedRequest, WorkPlan, step_block_ranges


@dataclass(slots=True, frozen=True)
class EnqueueLogEntry:
    """Replica bookkeeping (not upstream): what ``_submit_ready_layer_loads`` enqueued."""

    step: int
    current_layer: int
    layer_id: int
    wait_for_save_layer: int | None
    gate: object


class KVPoolWorker:
    """Producer side of the layerwise pipeline for one rank."""

    def __init__(
        self, cfg: ReplicaConfig, plan: WorkPlan, npu: FakeNPU, *, wait_timeout_s: float = 10.0, keep_log: bool = True
    ) -> None:
        cfg.validate()
        self.cfg = cfg
        self.plan = plan
        self.npu = npu
        self.num_layers = cfg.num_layers
        self.tp_rank, self.tp_size = cfg.tp_rank, cfg.tp_size
        self.pp_rank = self.pcp_rank = self.dcp_rank = self.dp_rank = self.local_rank = 0
        self.dcp_size = 1
        self.kv_role = "kv_both"
        self.model_name = "replica"
        self.use_gva_layerwise = cfg.path == "gva"
        self.num_prefetch_layers = cfg.resolved_prefetch
        self._layerwise_reuse_layout = build_layout(cfg)
        self.prefetch_layer_map = dict(self._layerwise_reuse_layout.prefetch_layer_map)
        self.independent_layers = list(cfg.resolved_independent)
        self.current_layer = 0
        self.next_layer_to_submit = 0
        self.layer_load_tasks: list[list[LayerTransferTask]] = [[] for _ in range(cfg.num_layers)]
        self.layer_save_tasks: list[list[LayerTransferTask]] = [[] for _ in range(cfg.num_layers)]
        self.block_size = 128
        self.page_size_bytes = 4096
        self.token_database = FakeTokenDatabase(plan, npu, self.page_size_bytes)
        self.m_store = FakeMStore(plan, npu, lease_release_ns=plan.lease_release_ns)
        self.wait_timeout_s = wait_timeout_s
        self.external_slot_release_waiter = SlotReleaseWaiter(self) if plan.has_slot_release_waiter else None
        self.kv_recv_thread: KVTransferThread | None = None
        self.kv_send_thread: KVTransferThread | None = None
        self._step = -1
        self._step_start_ns = 0
        self.keep_log = keep_log
        """Keep ``enqueue_log`` / ``gates_by_layer`` (they grow with the run: off for long runs)."""
        self.enqueue_log: list[EnqueueLogEntry] = []
        self.gates_by_layer: dict[tuple[int, int], object] = {}

    # -- setup ---------------------------------------------------------------------------------------
    def register_kv_caches(self) -> None:
        self._start_kv_transfer_threads()

    def _build_group_layer_builders(self) -> list[LayerBatchBuilder]:
        return [LayerBatchBuilder(self.token_database, self.page_size_bytes, self.num_layers, 0)]

    def _start_kv_transfer_threads(self) -> None:
        n = self.num_layers
        behaviour = self.cfg.behaviour
        self.get_event = threading.Event()
        self.layer_load_finished_events = [threading.Event() for _ in range(n)]
        self.layer_save_finished_events = [threading.Event() for _ in range(n)]
        self.sync_save_events = [self.npu.Event() for _ in range(n)]
        send_ready, recv_ready = threading.Event(), threading.Event()
        common = (self.m_store, self.token_database, self.block_size, self.tp_rank, self.tp_size, self.dcp_size)
        if self.use_gva_layerwise:
            self.kv_send_thread = KVCacheStoreLayerSendingThread(
                *common, self.page_size_bytes, send_ready, self.layer_save_finished_events,
                self.sync_save_events, n, group_builders=self._build_group_layer_builders(),
                behaviour=behaviour, wait_timeout_s=self.wait_timeout_s)
            self.kv_recv_thread = KVCacheStoreLayerRecvingThread(
                *common, self.page_size_bytes, recv_ready, self.get_event, self.layer_load_finished_events,
                self.layer_save_finished_events, self.sync_save_events, n,
                h2d_stagger_us=self.cfg.timing.h2d_stagger_us,
                group_builders=self._build_group_layer_builders(),
                external_slot_release_waiter=self.external_slot_release_waiter if behaviour == "main" else None,
                save_failure_checker=self.kv_send_thread.raise_if_failed if behaviour == "main" else None,
                behaviour=behaviour, wait_timeout_s=self.wait_timeout_s)
        else:
            self.kv_send_thread = KVCacheStoreKeyLayerSendingThread(
                *common, self.page_size_bytes, send_ready, self.layer_save_finished_events,
                self.sync_save_events, n, behaviour=behaviour, wait_timeout_s=self.wait_timeout_s)
            self.kv_recv_thread = KVCacheStoreKeyLayerRecvingThread(
                *common, recv_ready, self.get_event, self.layer_load_finished_events,
                self.layer_save_finished_events, n, behaviour=behaviour, wait_timeout_s=self.wait_timeout_s)
        if self.cfg.scheduler != "fifo":
            from otel_kvtrace.schedule import attach

            attach(self.kv_recv_thread, self.cfg.scheduler)
        self.kv_send_thread.start()
        self.kv_recv_thread.start()
        send_ready.wait()
        recv_ready.wait()

    def shutdown(self, timeout_s: float = 5.0) -> bool:
        """Stop both threads with the ``None`` sentinel; True when both ended in time."""
        ok = True
        for thread in (self.kv_recv_thread, self.kv_send_thread):
            if thread is None:
                continue
            if thread.is_alive():
                thread.stop()
                thread.join(timeout_s)
            ok = ok and not thread.is_alive()
        return ok

    def drain(self, timeout_s: float = 5.0) -> bool:
        """Between steps: both transfer threads idle (:func:`drain_threads`) and the device done with
        what was launched, so the next step starts from idle threads and an idle device."""
        ok = drain_threads((self.kv_recv_thread, self.kv_send_thread), timeout_s)
        self.npu.clock.sleep_until(self.npu.compute.point_ns())
        return ok

    def slot_release_time(self, layer_id: int) -> int:
        """When a sibling connector frees the layer's slot this step: ``plan.slot_release`` after the
        step started (an absolute time, whoever asks)."""
        return self._step_start_ns + self.plan.slot_release[self._step * self.num_layers + layer_id]

    # -- per step ------------------------------------------------------------------------------------
    def start_load_kv(self, requests: list[PlannedRequest]) -> None:
        """Step entry (research §2.3): reset the window, fresh task lists, new gate, build the tasks."""
        self._step += 1
        self._step_start_ns = self.npu.clock.now_ns()
        self.current_layer = 0
        self.next_layer_to_submit = 0
        if self.cfg.behaviour == "main":
            self.layer_save_tasks = [[] for _ in range(self.num_layers)]
            self.layer_load_tasks = [[] for _ in range(self.num_layers)]
        else:
            for lst in self.layer_save_tasks:
                lst.clear()
            for lst in self.layer_load_tasks:
                lst.clear()
        gate_module.reset_attention_compute_start_gate()
        if not requests:
            return
        self.process_layer_data(requests)

    def process_layer_data(self, requests: list[PlannedRequest]) -> None:
        """Build every layer's save and load tasks (and their shared data) for this step."""
        full, partial = step_block_ranges(self.plan, self._step)
        builder = self._build_group_layer_builders()[0]
        for layer in range(self.num_layers):
            if full:
                self.layer_save_tasks[layer].append(LayerTransferTask(layer, full, 0, layer, step=self._step))
            ranges = partial if layer in self.plan.partial_layers else full
            if ranges:
                self.layer_load_tasks[layer].append(LayerTransferTask(layer, ranges, 0, layer, step=self._step))
        # upstream _build_shared_save_data / _build_shared_load_data: ONE shared block list per group and step,
        # built from the first layer that has a task and attached to every task (the key path builds per task)
        for lists in (self.layer_save_tasks, self.layer_load_tasks):
            if lists is self.layer_load_tasks and not self.use_gva_layerwise:
                continue
            first = next((tasks[0] for tasks in lists if tasks), None)
            if first is None:
                continue
            shared: SharedBlockData = builder.build_shared(first)
            for tasks in lists:
                for task in tasks:
                    task.shared_block_data = shared

    def wait_for_layer_load(self) -> None:
        """Before layer ``current_layer``'s attention: new gate, submit the window, wait for the load."""
        main = self.cfg.behaviour == "main"
        recv = self.kv_recv_thread
        assert recv is not None
        c = self.current_layer
        if main:
            recv.raise_if_failed()
        gate = gate_module.reset_attention_compute_start_gate()
        if self.keep_log:
            self.gates_by_layer[(self._step, c)] = gate
        self._submit_ready_layer_loads()
        has = bool(self.layer_load_tasks[c])
        event = self.layer_load_finished_events[c]
        if not should_wait(self.cfg, self._layerwise_reuse_layout, c, has):
            event.clear()
            if main and self.external_slot_release_waiter is not None:
                self.external_slot_release_waiter(c)
            return
        if main:
            while not event.wait(timeout=self.wait_timeout_s):
                recv.raise_if_failed()
        elif not event.wait(timeout=self.wait_timeout_s):
            return  # v0.23 proceeds on stale KV after one timeout
        event.clear()

    def _submit_ready_layer_loads(self) -> None:
        recv = self.kv_recv_thread
        assert recv is not None
        c = self.current_layer
        count = submit_count(c, self.num_prefetch_layers)
        submitted = 0
        while submitted < count and self.next_layer_to_submit < self.num_layers:
            layer = self.next_layer_to_submit
            self.next_layer_to_submit += 1
            sub = plan_submission(layer, c, bool(self.layer_load_tasks[layer]), self.prefetch_layer_map,
                                  self.cfg.behaviour)
            if sub is None:
                continue
            gate = gate_module.get_attention_compute_start_gate() if sub.gate_layer is not None else None
            task = LayerLoadTask(sub.wait_for_save_layer, self.layer_load_tasks[layer], layer, gate)
            if self.keep_log:
                self.enqueue_log.append(EnqueueLogEntry(self._step, c, layer, sub.wait_for_save_layer, gate))
            recv.add_request(task)
            submitted += 1

    def save_kv_layer(self, connector_metadata: object = None) -> None:
        """After layer ``current_layer``'s attention: record the save point, hand over the save."""
        main = self.cfg.behaviour == "main"
        send = self.kv_send_thread
        assert send is not None
        c = self.current_layer
        if main:
            send.raise_if_failed()
        self.sync_save_events[c].record()
        tasks = self.layer_save_tasks[c]
        if tasks:
            send.add_request(list(tasks))
        else:
            self.layer_save_finished_events[c].set()
        if c == self.num_layers - 1:
            last = self.layer_save_finished_events[c]
            if main:
                while not last.wait(timeout=self.wait_timeout_s):
                    send.raise_if_failed()
                sources = set(self.prefetch_layer_map.values())
                for layer, event in enumerate(self.layer_save_finished_events):
                    if layer not in sources:
                        event.clear()
            else:
                last.wait(timeout=self.wait_timeout_s)
                for event in self.layer_save_finished_events:
                    event.clear()
        self.current_layer += 1


def drain_threads(threads: tuple[object, ...], timeout_s: float = 5.0) -> bool:
    """Wait until each transfer thread called ``task_done`` for everything queued (the final layer's
    lease included; upstream's threads as the replica's). False when one did not finish in time."""
    ok = True
    for thread in threads:
        q = getattr(thread, "request_queue", None)
        if q is not None:
            with q.all_tasks_done:
                ok = q.all_tasks_done.wait_for(lambda q=q: not q.unfinished_tasks, timeout_s) and ok
    return ok


class SlotReleaseWaiter:
    """The external slot release waiter (upstream: a sibling connector's send of the same slot).

    Calling it blocks until the slot is free. ``kvtrace_release_time(layer)`` is the producer side of
    that dependency, in the recorder's clock (``perf_counter_ns``): the instrumentation uses it to
    export the exact release time instead of bounds, so a queued task's readiness is known. A real
    provider can offer the same method.
    """

    def __init__(self, worker: KVPoolWorker) -> None:
        self._worker = worker

    def __call__(self, layer_id: int) -> None:
        self._worker.npu.clock.sleep_until(self._worker.slot_release_time(layer_id))

    def kvtrace_release_time(self, layer_id: int) -> int:
        return self._worker.slot_release_time(layer_id)
