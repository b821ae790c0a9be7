"""A deterministic CPU replica of vLLM V1's engine loop on a fake device and a virtual clock.

The classes mirror the shapes the instrumentation wraps (``EngineCore.step`` /
``step_with_batch_queue``, ``Scheduler.schedule`` / ``update_from_output``, ``Executor.execute_model``
returning a future, ``…Output.get_output``), so a replica run is traced by the very same patch table as
a real vLLM process and yields trace files in the same format. Modes:

- ``sync``: ``EngineCore.step``: schedule, launch, wait for the output, update.
- ``async``: ``step_with_batch_queue`` with a batch queue of depth 2: schedule(n+1) runs while the
  device executes step n.
- ``serialised``: the async loop, but ``execute_model`` blocks on a device synchronize after the launch
  (what a synchronising profiler hook or ``ASCEND_LAUNCH_BLOCKING=1`` does), so nothing overlaps.

Each step's device program is ``layers`` x (compute, communication); with ``comm_overlap`` the
communication of layer i runs on a second stream under the compute of layer i+1.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from otel_kvtrace.asynccheck.export import DEFAULT_DIR, AsyncTracer, default_resource
from otel_kvtrace.asynccheck.instrument import EngineLoopInstrumentation
from otel_kvtrace.asynccheck.recorder import StampBuffer, StampKind
from otel_kvtrace.record.recorder import ClockAnchor

MODES = ("sync", "async", "serialised")


@dataclass(slots=True, frozen=True)
class ReplicaConfig:
    """Costs in virtual ns. Defaults: 4 ms of host work per step against 10 ms of device work."""

    mode: str = "async"
    num_steps: int = 24
    schedule_ns: int = 2_000_000
    launch_ns: int = 1_000_000
    update_ns: int = 1_000_000
    layers: int = 4
    compute_ns: int = 2_000_000
    comm_ns: int = 500_000
    comm_overlap: bool = False
    batch_queue_size: int = 2
    dp_sync_ns: int = 0
    """Cost of the DP engines' "unfinished requests" all-reduce on the engine loop; 0 = one DP rank."""
    dp_sync_every: int = 1
    epoch_ns: int = 1_767_225_600_000_000_000  # 2026-01-01T00:00:00Z

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.num_steps < 1 or self.layers < 1 or self.batch_queue_size < 1:
            raise ValueError("num_steps, layers and batch_queue_size must be >= 1")


class VirtualClock:
    """Monotonic virtual ns; callable like ``time.perf_counter_ns``."""

    def __init__(self, now_ns: int = 0) -> None:
        self.now_ns = now_ns

    def __call__(self) -> int:
        return self.now_ns

    def advance(self, ns: int) -> None:
        self.now_ns += ns


class FakeDevice:
    """One compute stream and one communication stream; work runs in launch order."""

    def __init__(self, clock: VirtualClock, buffer: StampBuffer) -> None:
        self.clock = clock
        self.buffer = buffer
        self.free_at = 0

    def run(self, step: int, cfg: ReplicaConfig) -> int:
        """Queue one step's program; return its completion time. Records compute/comm intervals."""
        t = max(self.clock.now_ns, self.free_at)
        comm_free = t
        for _ in range(cfg.layers):
            compute_end = t + cfg.compute_ns
            self.buffer.put(StampKind.COMPUTE, t, compute_end, step)
            if not cfg.comm_ns:
                t = compute_end
                continue
            comm_start = max(compute_end, comm_free)
            comm_free = comm_start + cfg.comm_ns
            self.buffer.put(StampKind.COMM, comm_start, comm_free, step)
            t = compute_end if cfg.comm_overlap else comm_free
        self.free_at = max(t, comm_free)
        return self.free_at

    def synchronize(self) -> None:
        self.clock.now_ns = max(self.clock.now_ns, self.free_at)


@dataclass(slots=True)
class SchedulerOutput:
    step: int
    total_num_scheduled_tokens: int = 1


class ReplicaModelRunnerOutput:
    """Stands in for ``AsyncGPUModelRunnerOutput``: ``get_output`` returns when the device is done."""

    def __init__(self, step: int) -> None:
        self.step = step

    def get_output(self) -> int:
        return self.step


_OUTPUT_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ReplicaAsyncOutput")
"""Where ``get_output`` runs, as on vLLM's output threads (so the trace labels it ``device_ready``)."""


class VirtualFuture:
    """The executor's future. ``result()`` replays the output thread's ``get_output`` at device completion."""

    def __init__(self, clock: VirtualClock, output: ReplicaModelRunnerOutput, done_ns: int) -> None:
        self.clock = clock
        self.output = output
        self.done_ns = done_ns
        self._value: Any = None
        self._resolved = False

    def done(self) -> bool:
        return self.clock.now_ns >= self.done_ns

    def result(self) -> Any:
        if not self._resolved:
            now = self.clock.now_ns
            self.clock.now_ns = self.done_ns  # the output thread returns from get_output right here
            self._value = _OUTPUT_THREAD.submit(self.output.get_output).result()
            self.clock.now_ns = max(now, self.done_ns)
            self._resolved = True
        return self._value


class ReplicaDPGroup:
    """The DP process group: an all-reduce costs ``dp_sync_ns`` of engine-loop time."""

    def __init__(self, clock: VirtualClock, cost_ns: int) -> None:
        self.clock = clock
        self.cost_ns = cost_ns


class ReplicaParallelConfig:
    @staticmethod
    def has_unfinished_dp(dp_group: ReplicaDPGroup, has_unfinished: bool) -> bool:
        """Like ``vllm.config.ParallelConfig.has_unfinished_dp``: a CPU all-reduce across DP ranks."""
        dp_group.clock.advance(dp_group.cost_ns)
        return has_unfinished

    @staticmethod
    def sync_dp_state(dp_group: ReplicaDPGroup, has_unfinished: bool, pending_pause: bool) -> tuple[bool, bool]:
        """Like vLLM 0.23's ``ParallelConfig.sync_dp_state`` (0.33: an instance method): one all-reduce."""
        dp_group.clock.advance(dp_group.cost_ns)
        return has_unfinished, pending_pause


class ReplicaScheduler:
    def __init__(self, clock: VirtualClock, cfg: ReplicaConfig) -> None:
        self.clock = clock
        self.cfg = cfg
        self.scheduled = 0

    def has_requests(self) -> bool:
        return self.scheduled < self.cfg.num_steps

    def schedule(self) -> SchedulerOutput:
        self.clock.advance(self.cfg.schedule_ns)
        out = SchedulerOutput(self.scheduled)
        self.scheduled += 1
        return out

    def update_from_output(self, scheduler_output: SchedulerOutput, model_output: Any) -> None:
        self.clock.advance(self.cfg.update_ns)


class ReplicaExecutor:
    def __init__(self, clock: VirtualClock, device: FakeDevice, cfg: ReplicaConfig) -> None:
        self.clock = clock
        self.device = device
        self.cfg = cfg

    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False) -> VirtualFuture:
        self.clock.advance(self.cfg.launch_ns)
        done = self.device.run(scheduler_output.step, self.cfg)
        if self.cfg.mode == "serialised":
            self.device.synchronize()  # the inserted blocking sync
        return VirtualFuture(self.clock, ReplicaModelRunnerOutput(scheduler_output.step), done)


class ReplicaEngineCore:
    """``EngineCore`` with vLLM's two step functions (``vllm/v1/engine/core.py``)."""

    def __init__(
        self,
        clock: VirtualClock,
        buffer: StampBuffer,
        cfg: ReplicaConfig,
        scheduler_cls: type[ReplicaScheduler] | None = None,
    ) -> None:
        self.scheduler = (scheduler_cls or ReplicaScheduler)(clock, cfg)
        self.model_executor = ReplicaExecutor(clock, FakeDevice(clock, buffer), cfg)
        self.batch_queue_size = cfg.batch_queue_size if cfg.mode != "sync" else 1
        self.batch_queue: deque[tuple[VirtualFuture, SchedulerOutput]] | None = None
        if self.batch_queue_size > 1:
            self.batch_queue = deque(maxlen=self.batch_queue_size)
        self.step_fn = self.step if self.batch_queue is None else self.step_with_batch_queue
        self.cfg = cfg
        self.dp_group = ReplicaDPGroup(clock, cfg.dp_sync_ns) if cfg.dp_sync_ns else None
        self.step_counter = 0

    def step(self) -> bool:
        if not self.scheduler.has_requests():
            return False
        so = self.scheduler.schedule()
        future = self.model_executor.execute_model(so, non_block=True)
        output = future.result()
        self.scheduler.update_from_output(so, output)
        return True

    def step_with_batch_queue(self) -> bool:
        queue = self.batch_queue
        assert queue is not None
        if self.scheduler.has_requests():
            so = self.scheduler.schedule()
            future = self.model_executor.execute_model(so, non_block=True)
            queue.appendleft((future, so))
            if len(queue) < self.batch_queue_size and not queue[-1][0].done():
                return True  # don't block on the oldest result: this is the overlap
        elif not queue:
            return False
        future, so = queue.pop()
        output = future.result()
        self.scheduler.update_from_output(so, output)
        return True

    def _has_global_unfinished_reqs(self, local_unfinished: bool) -> bool:
        """``DPEngineCoreProc``'s check after each step: all-reduce every ``dp_sync_every`` steps."""
        self.step_counter += 1
        if self.dp_group is None or self.step_counter % self.cfg.dp_sync_every:
            return local_unfinished
        return ReplicaParallelConfig.has_unfinished_dp(self.dp_group, local_unfinished)

    def run(self) -> None:
        while True:
            executed = self.step_fn()
            self._has_global_unfinished_reqs(executed)
            if not executed:
                return


REPLICA_OWNERS = {
    "engine": (ReplicaEngineCore,),
    "scheduler": (ReplicaScheduler,),
    "executor": (ReplicaExecutor,),
    "output": (ReplicaModelRunnerOutput,),
    "dp_sync": (ReplicaParallelConfig,),
}


def run_replica(
    config: ReplicaConfig,
    *,
    out_dir: Path = DEFAULT_DIR,
    label: str | None = None,
    meter_provider: Any = None,
) -> Path:
    """Run the replica engine loop traced by the real patch table; return the OTLP JSON lines file."""
    clock = VirtualClock()
    buffer = StampBuffer(capacity=config.num_steps * (8 + 2 * config.layers) + 64, clock=clock)
    resource = default_resource(
        run_id=f"replica-{config.mode}",
        source="replica",
        label=label or f"replica {config.mode}",
        extra={"process.pid": 0, "host.name": "replica", "async.mode": config.mode},
    )
    path = Path(out_dir) / f"kvtrace-async-replica-{config.mode}.jsonl"
    path.unlink(missing_ok=True)
    tracer = AsyncTracer(
        path=path,
        resource=resource,
        buffer=buffer,
        anchor=ClockAnchor(0, config.epoch_ns),
        meter_provider=meter_provider,
    )
    instrumentation = EngineLoopInstrumentation(buffer, owners=REPLICA_OWNERS)
    instrumentation.install()
    try:
        ReplicaEngineCore(clock, buffer, config).run()
    finally:
        instrumentation.uninstall()
    tracer.flush(settle_s=0)
    tracer.shutdown()
    return path
