"""The stand-in model of ``kvtrace serve-replica``: continuous batching over the threaded replica.

One engine thread plays vLLM's engine core: every step it admits waiting requests (up to
``max_num_seqs`` running), runs one forward step of the replica's layerwise pipeline
(``replica.threaded.forward_step``: real recv/send threads, fake NPU, the KV tasks of the step's
prefills), and then hands every running request one token. A request's prefill step carries its KV
load and save tasks (block count from its prompt length), so the recv queue, HOL blocking and the
tracing are exactly those of ``kvtrace demo``; decode steps run the layers without pool transfers.

The step's durations come from the replica's own work plan: each step samples a one-step plan for the
step's batch and writes it into a ring of ``RING_STEPS`` rows that the worker and its threads read.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from otel_kvtrace.replica.config import ReplicaConfig
from otel_kvtrace.replica.fake_npu import FakeNPU, RealClock, set_default_device
from otel_kvtrace.replica.plan import DURATION_TABLES, PlannedRequest, WorkPlan, build_plan
from otel_kvtrace.replica.pool_worker import KVPoolWorker
from otel_kvtrace.replica.threaded import forward_step

RING_STEPS = 64
"""Plan rows kept; a row is rewritten only after its step's loads, saves and lease releases are done."""
_PER_LAYER_TABLES = (*DURATION_TABLES, "load_blocks", "stagger", "late_gate")


@dataclass(slots=True)
class EngineRequest:
    """One admitted request. ``on_token(index, unix_ns)`` runs on the engine thread: keep it short."""

    kv_request_id: str
    prompt_tokens: int
    max_tokens: int
    on_token: Callable[[int, int], None]
    generated: int = 0


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    prefill_steps: int = 0
    tokens: int = 0
    finished: int = 0
    running: int = 0
    waiting: int = 0
    error: str | None = None
    step_ns: deque[int] = field(default_factory=lambda: deque(maxlen=1024))


class ReplicaEngine:
    """Continuous batching over one replica ``KVPoolWorker``; ``submit`` is thread-safe."""

    def __init__(self, cfg: ReplicaConfig, *, max_num_seqs: int = 8, block_tokens: int = 128,
                 on_step: Callable[[int], None] | None = None, wait_timeout_s: float = 10.0) -> None:
        cfg = replace(cfg, steps=RING_STEPS, requests_per_step=0, chunks_per_request=1,
                      slow=replace(cfg.slow, fail_copy_at=None)).validate()
        if max_num_seqs < 1 or block_tokens < 1:
            raise ValueError("max_num_seqs and block_tokens must be >= 1")
        self.cfg = cfg
        self.max_num_seqs = max_num_seqs
        self.block_tokens = block_tokens
        self.on_step = on_step
        self.stats = EngineStats()
        self.npu = FakeNPU(RealClock())
        set_default_device(self.npu)
        self.plan: WorkPlan = build_plan(cfg)
        self.worker = KVPoolWorker(cfg, self.plan, self.npu, wait_timeout_s=wait_timeout_s, keep_log=False)
        self._waiting: deque[EngineRequest] = deque()
        self._running: list[EngineRequest] = []
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="kvtrace-serve-engine", daemon=True)

    # -- control --------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the KV transfer threads (the instrumentation adopts them) and the engine loop."""
        self.worker.register_kv_caches()
        self._thread.start()

    def submit(self, request: EngineRequest) -> None:
        with self._cond:
            if self._stop:
                raise RuntimeError("engine stopped")
            self._waiting.append(request)
            self._cond.notify()

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Stop after the current step, then stop the transfer threads; True when all ended in time."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        return self.worker.shutdown(timeout_s) and not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.stats.error is None

    # -- engine thread --------------------------------------------------------------------------------
    def _admit(self) -> list[EngineRequest] | None:
        """New prefills for this step, waiting while idle; ``None`` once stopped."""
        with self._cond:
            while not self._stop and not self._waiting and not self._running:
                self._cond.wait(0.5)
            if self._stop:
                return None
            new = []
            while self._waiting and len(self._running) + len(new) < self.max_num_seqs:
                new.append(self._waiting.popleft())
            self.stats.waiting = len(self._waiting)
            return new

    def _loop(self) -> None:
        step = 0
        prefills: list[EngineRequest] = []
        try:
            while True:
                admitted = self._admit()
                if admitted is None:
                    return
                prefills = admitted
                t0 = time.perf_counter_ns()
                slot = step % RING_STEPS
                self._fill_row(slot, step, prefills)
                self.worker._step = slot - 1  # replica bookkeeping: the row start_load_kv will read
                forward_step(self.worker, self.plan, self.npu, slot)
                self._running.extend(prefills)
                prefills = []
                self._emit_tokens()
                self.stats.steps += 1
                self.stats.prefill_steps += bool(admitted)
                self.stats.step_ns.append(time.perf_counter_ns() - t0)
                if self.on_step is not None:
                    self.on_step(step)
                step += 1
        except Exception as exc:  # the forward failed: like vLLM's engine core, stop serving
            self.stats.error = f"{type(exc).__name__}: {exc}"
            with self._cond:
                self._stop = True
                # the step's prefills are not in _running yet: they fail too
                failed, self._waiting = list(self._waiting) + self._running + (prefills or []), deque()
                self._running = []
            for req in failed:
                req.on_token(-1, time.time_ns())

    def _emit_tokens(self) -> None:
        now = time.time_ns()
        still = []
        for req in self._running:
            req.on_token(req.generated, now)
            req.generated += 1
            self.stats.tokens += 1
            if req.generated < req.max_tokens:
                still.append(req)
            else:
                self.stats.finished += 1
        self._running = still
        self.stats.running = len(still)

    def _fill_row(self, slot: int, step: int, prefills: list[EngineRequest]) -> None:
        """Sample the step's durations for its batch and write them into ring row ``slot``."""
        blocks = [max(1, math.ceil(r.prompt_tokens / self.block_tokens)) for r in prefills]
        per_request = max(1, round(sum(blocks) / len(blocks))) if blocks else 1
        one = build_plan(replace(self.cfg, steps=1, requests_per_step=len(prefills), seed=self.cfg.seed * 1_000_003 + step,
                                 timing=replace(self.cfg.timing, blocks_per_request=per_request)), validate=False)
        n, plan = self.plan.num_layers, self.plan
        for name in _PER_LAYER_TABLES:
            getattr(plan, name)[slot * n:(slot + 1) * n] = getattr(one, name)
        plan.blocks[slot] = one.blocks[0]
        plan.requests[slot] = [_rename(r, req.kv_request_id) for r, req in zip(one.requests[0], prefills, strict=True)]


def _rename(planned: PlannedRequest, req_id: str) -> PlannedRequest:
    return replace(planned, req_id=req_id)
