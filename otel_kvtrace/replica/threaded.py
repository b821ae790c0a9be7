"""Real-clock threaded replica: a forward loop driving ``KVPoolWorker`` and its transfer threads.

Per step: ``start_load_kv``; per layer ``wait_for_layer_load`` -> gate ``record()`` at attention start
(the attention kernel is launched on the fake NPU's compute stream) -> ``save_kv_layer`` -> rest of the
layer's compute -> host launch time. The instrumentation attaches to the classes ``replica_targets()``
returns, exactly as it attaches to vLLM-Ascend.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from otel_kvtrace.replica import gate as gate_module
from otel_kvtrace.replica.config import ReplicaConfig
from otel_kvtrace.replica.fake_npu import FakeNPU, RealClock, set_default_device
from otel_kvtrace.replica.kv_transfer import (
    KVCacheStoreKeyLayerRecvingThread,
    KVCacheStoreKeyLayerSendingThread,
    KVCacheStoreLayerRecvingThread,
    KVCacheStoreLayerSendingThread,
)
from otel_kvtrace.replica.plan import WorkPlan, build_plan
from otel_kvtrace.replica.pool_worker import EnqueueLogEntry, KVPoolWorker


def replica_targets(behaviour: str = "main") -> dict[str, object]:
    """The replica's classes by role (the keys of ``otel_kvtrace.instrument.targets.Targets``)."""
    return {
        "worker_class": KVPoolWorker,
        "recv_thread_classes": (KVCacheStoreLayerRecvingThread, KVCacheStoreKeyLayerRecvingThread),
        "send_thread_classes": (KVCacheStoreLayerSendingThread, KVCacheStoreKeyLayerSendingThread),
        "gate_class": gate_module.AttentionComputeStartGate,
        "source": "replica",
        "version": f"replica-{behaviour}",
    }


@dataclass(slots=True)
class ThreadedResult:
    """What a threaded run did (wall-clock ns from ``time.perf_counter_ns``)."""

    config: ReplicaConfig
    steps_done: int
    step_ns: list[int]
    enqueue_log: list[EnqueueLogEntry]
    gates_by_layer: dict[tuple[int, int], object]
    lease_releases: list[tuple[int, int]]
    finished_requests: set[str]
    error: BaseException | None = None
    clean_shutdown: bool = True
    unfinished_tasks: dict[str, int] = field(default_factory=dict)
    """``request_queue.unfinished_tasks`` per thread after shutdown (0 = no lost ``task_done``)."""


def forward_step(worker: KVPoolWorker, plan: WorkPlan, npu: FakeNPU, step: int) -> None:
    """One forward step of the model: ``start_load_kv``, then per layer wait -> gate -> attention -> save ->
    compute -> host launch, with the durations of ``plan`` row ``step`` (the one home of the forward loop:
    ``run_threaded`` and the serving engine both call it)."""
    clock, compute, n = npu.clock, npu.compute, plan.num_layers
    worker.start_load_kv(plan.requests[step])
    base = step * n
    for layer in range(n):
        i = base + layer
        worker.wait_for_layer_load()
        if plan.late_gate[i]:
            clock.sleep_until(clock.now_ns() + plan.late_gate[i])
        gate_module.record_attention_compute_start()
        compute.launch(("attention", i), plan.attention[i])
        worker.save_kv_layer(None)
        compute.launch(("compute", i), plan.compute[i])
        clock.sleep_until(clock.now_ns() + plan.host_launch[i])


def run_threaded(
    cfg: ReplicaConfig,
    *,
    on_step: Callable[[int], None] | None = None,
    wait_timeout_s: float = 10.0,
    shutdown_timeout_s: float = 5.0,
    npu: FakeNPU | None = None,
    keep_log: bool = True,
    plan: WorkPlan | None = None,
    before_step: Callable[[KVPoolWorker, int], None] | None = None,
) -> ThreadedResult:
    """Run ``cfg`` on real threads and the real clock. Errors raised by the forward are captured.

    Pass ``npu`` (a real-clock ``FakeNPU``, e.g. with ``keep_kernels``) to inspect the device timeline;
    ``keep_log=False`` drops the per-task enqueue log (memory stays flat on long runs). ``plan``: the
    work to run (default ``build_plan(cfg)``; its ``steps`` rows are run). ``before_step(worker, step)``
    runs on the forward thread before each step, untimed (the fidelity bench drains and switches the
    live scheduler there); an exception in it ends the run like one in the forward.
    """
    cfg.validate()
    plan = plan if plan is not None else build_plan(cfg)
    npu = npu if npu is not None else FakeNPU(RealClock())
    set_default_device(npu)
    worker = KVPoolWorker(cfg, plan, npu, wait_timeout_s=wait_timeout_s, keep_log=keep_log)
    worker.register_kv_caches()
    step_ns: list[int] = []
    error: BaseException | None = None
    done = 0
    try:
        for step in range(plan.steps):
            if before_step is not None:
                before_step(worker, step)
            t0 = time.perf_counter_ns()
            forward_step(worker, plan, npu, step)
            step_ns.append(time.perf_counter_ns() - t0)
            done += 1
            if on_step is not None:
                on_step(step)
    except Exception as exc:
        error = exc
    clean = worker.shutdown(shutdown_timeout_s)
    unfinished = {
        t.name: t.request_queue.unfinished_tasks
        for t in (worker.kv_recv_thread, worker.kv_send_thread) if t is not None
    }
    recv = worker.kv_recv_thread
    return ThreadedResult(
        cfg, done, step_ns, worker.enqueue_log, worker.gates_by_layer, list(worker.m_store.lease_releases),
        set(recv.finished_requests) if recv is not None else set(), error, clean, unfinished,
    )
