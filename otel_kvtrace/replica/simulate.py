"""Virtual-clock engine: the layerwise load/save pipeline as a small discrete-event simulation.

Three actors (forward, recv, send) are generators that run until they wait on a ``Signal`` whose time is
not known yet (a load event, a save event, a gate record, a queue item). When a signal fires, the waiting
actor's resume is pushed on one heap ordered by the single key ``(time, seq)``; the loop pops it and runs
the actor on. A wait on a signal that already fired costs no event: the actor just takes
``max(now, fired_time)``. Device work uses the fake NPU's stream arithmetic (``fake_npu.Stream``) on the
virtual clock, so device completion times are exact.

Output: one ``TaskRecord`` per recv task and per save task, filled exactly as the instrumentation fills
them on real threads, plus per-step forward figures (``SimResult``).
"""

from __future__ import annotations

import gc
import heapq
import time
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path

from otel_kvtrace.record.model import NO_TIME, Dep, Outcome, QueueInfo, Stage, TaskKind, TaskRecord
from otel_kvtrace.record.recorder import ClockAnchor, Recorder
from otel_kvtrace.replica.config import ReplicaConfig
from otel_kvtrace.replica.fake_npu import VirtualClock
from otel_kvtrace.replica.layout import ReuseLayout, build_layout, enqueue_plan, should_wait
from otel_kvtrace.replica.metadata import LayerTransferTask
from otel_kvtrace.replica.plan import WorkPlan, build_plan, step_block_ranges

RECV_THREAD_NAMES = {"gva": "KVCacheStoreLayerRecvingThread", "key": "KVCacheStoreKeyLayerRecvingThread"}
SEND_THREAD_NAMES = {"gva": "KVCacheStoreLayerSendingThread", "key": "KVCacheStoreKeyLayerSendingThread"}
BLOCK_BYTES = 4096
"""Bytes per block the replica reports (a nominal page size; only ``bytes`` attributes use it)."""
DEFAULT_EPOCH_NS = 1_767_225_600_000_000_000  # 2026-01-01T00:00:00Z: virtual time 0 maps here


class EventLoop:
    """Heap of ``(time, seq, actor, value)`` with ``seq`` breaking ties in push order, plus signals.

    A signal is an index into one flat ``times`` list (``-1`` until fired). An actor is a generator that
    yields the signal index it waits for and receives the signal's fire time.
    """

    __slots__ = ("heap", "seq", "events", "times", "waiters")

    def __init__(self, num_signals: int) -> None:
        self.heap: list[tuple[int, int, _Actor, int | None]] = []
        self.seq = 0
        self.events = 0
        self.times = [-1] * num_signals
        self.waiters: dict[int, _Actor] = {}

    def fire(self, sig: int, t: int) -> None:
        """Fire ``sig`` at ``t`` and schedule the actor waiting on it (at most one per signal)."""
        self.times[sig] = t
        actor = self.waiters.pop(sig, None)
        if actor is not None:
            self.seq += 1
            heapq.heappush(self.heap, (t if t > actor.blocked_at else actor.blocked_at, self.seq, actor, t))

    def start(self, actor: _Actor) -> None:
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


class _Actor:
    __slots__ = ("name", "gen", "blocked_at", "done")

    def __init__(self, name: str, gen: Generator[int, int, None]) -> None:
        self.name = name
        self.gen = gen
        self.blocked_at = 0
        self.done = False


@dataclass(slots=True)
class StepOutcome:
    """Forward-side figures of one step (ns on the virtual clock)."""

    step: int
    start_ns: int
    end_ns: int
    consumer_wait_ns: int
    lease_release_ns: int = NO_TIME


@dataclass(slots=True)
class SimResult:
    """Everything one virtual run produced. Times are virtual ns (0 = run start)."""

    config: ReplicaConfig
    layout: ReuseLayout
    recv: list[TaskRecord]
    """Recv tasks in enqueue (``seq``) order."""
    send: list[TaskRecord]
    steps: list[StepOutcome]
    recv_queue: QueueInfo
    send_queue: QueueInfo
    error: str | None = None
    events: int = 0
    copy_intervals: list[tuple[int, int, int, int]] = field(default_factory=list)
    """``(step, layer, start_ns, end_ns)`` of every load copy, for invariant checks."""

    @property
    def num_tasks(self) -> int:
        return len(self.recv) + len(self.send)

    @property
    def end_ns(self) -> int:
        return self.steps[-1].end_ns if self.steps else 0

    @property
    def total_consumer_wait_ns(self) -> int:
        return sum(s.consumer_wait_ns for s in self.steps)


def ready_time(rec: TaskRecord) -> int:
    """``max(t_enqueue, every dependency's upper bound)`` (docs/schema.md ``ts.ready``)."""
    t = rec.t_enqueue
    deps = rec.deps
    for i in range(1, len(deps), 2):
        if deps[i] > t:
            t = deps[i]
    return t


def simulate(cfg: ReplicaConfig, *, run_id: str | None = None, pid: int = 0) -> SimResult:
    """Run ``cfg`` on the virtual clock; deterministic for a given config (including its seed)."""
    cfg.validate()
    plan = build_plan(cfg, validate=False)
    # The run allocates many small long-lived records; cyclic GC passes over them cost more than the
    # simulation itself, and nothing here creates reference cycles that need collecting mid-run.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _Simulation(cfg, plan, run_id or f"replica-sim-s{cfg.seed}", pid).run()
    finally:
        if was_enabled:
            gc.enable()


_NO_DEPS = [NO_TIME] * (2 * len(Dep))


class _Simulation:
    """One run. Signals (indices into the loop's ``times``): load done, save done, gate recorded, one per
    (step, layer) each; then one per recv queue slot and one per send queue slot."""

    def __init__(self, cfg: ReplicaConfig, plan: WorkPlan, run_id: str, pid: int) -> None:
        self.cfg = cfg
        self.plan = plan
        self.layout = build_layout(cfg)
        total = cfg.steps * cfg.num_layers
        self.total = total
        self.loop = EventLoop(5 * total + 2)  # queue slot ranges hold one extra (the never-filled next slot)
        self.gate_npu = [0] * total
        self.save_npu = [0] * total
        self.recv_items: list[TaskRecord] = []
        self.send_items: list[TaskRecord] = []
        self.by_index: list[TaskRecord | None] = [None] * total
        self.steps: list[StepOutcome] = []
        self.error: str | None = None
        self.copies: list[tuple[int, int, int, int]] = []
        self.lease_release: dict[int, int] = {}
        path = cfg.path
        self.rq = QueueInfo(run_id, path, RECV_THREAD_NAMES[path], pid, tp=cfg.tp_rank, num_layers=cfg.num_layers)
        self.sq = QueueInfo(run_id, path, SEND_THREAD_NAMES[path], pid, tp=cfg.tp_rank, num_layers=cfg.num_layers)
        self.transfer_tasks = [self._transfer_tasks(step) for step in range(cfg.steps)]
        # The enqueue plan depends only on which layers have a load task: compute it once per pattern.
        self.windows = {
            pattern: [
                [(sub.layer_id, sub.wait_for_save_layer, sub.gate_layer) for sub in subs]
                for subs in enqueue_plan(cfg, pattern.__getitem__, self.layout)
            ]
            for pattern in {plan.load_pattern(step) for step in range(cfg.steps)}
        }

    def _transfer_tasks(self, step: int) -> list[list[LayerTransferTask]]:
        full, partial = step_block_ranges(self.plan, step)
        out: list[list[LayerTransferTask]] = []
        for layer in range(self.cfg.num_layers):
            ranges = partial if layer in self.plan.partial_layers else full
            out.append([LayerTransferTask(layer, ranges, 0, layer, step=step)] if ranges else [])
        return out

    def run(self) -> SimResult:
        loop = self.loop
        loop.start(_Actor("forward", self._forward()))
        loop.start(_Actor("recv", self._recv()))
        loop.start(_Actor("send", self._send()))
        loop.run()
        for outcome in self.steps:
            outcome.lease_release_ns = self.lease_release.get(outcome.step, NO_TIME)
        _fill_depths(self.recv_items)
        _fill_depths(self.send_items)
        return SimResult(
            self.cfg, self.layout, self.recv_items, self.send_items, self.steps, self.rq, self.sq,
            self.error, loop.events, self.copies,
        )

    # -- forward thread ------------------------------------------------------------------------------
    def _forward(self) -> Generator[int, int, None]:
        cfg, plan, loop = self.cfg, self.plan, self.loop
        fire, times, waiters = loop.fire, loop.times, loop.waiters
        n = cfg.num_layers
        total = self.total
        save_sig, gate_sig, rq_sig, sq_sig = total, 2 * total, 3 * total, 4 * total + 1
        main = cfg.behaviour == "main"
        layout = self.layout
        waits = {pattern: [should_wait(cfg, layout, c, has) for c, has in enumerate(pattern)] for pattern in self.windows}
        release_on_forward = main and plan.has_slot_release_waiter
        recv_items, send_items, by_index = self.recv_items, self.send_items, self.by_index
        gate_npu, save_npu = self.gate_npu, self.save_npu
        rq, sq = self.rq, self.sq
        attention, compute, host = plan.attention, plan.compute, plan.host_launch
        late_gate, slot_release = plan.late_gate, plan.slot_release
        recv_kind, send_kind, consumer = TaskKind.RECV, TaskKind.SEND, Stage.CONSUMER_WAIT
        last = n - 1
        now = 0
        tail = 0  # compute stream: device time when launched work finishes
        for step in range(cfg.steps):
            step_start = now
            consumer_wait = 0
            has = plan.has_transfer(step)  # saves happen whenever the step has requests
            tasks = self.transfer_tasks[step]
            pattern = plan.load_pattern(step)
            window = self.windows[pattern]
            wait_for = waits[pattern]
            base = step * n
            for c in range(n):
                i = base + c
                # wait_for_layer_load(c): gate G_c, submit the window, block on the load event
                for layer, src, gate in window[c]:
                    rec = TaskRecord(rq, recv_kind, len(recv_items), step, layer, layer == last, src, gate,
                                     0, 0, now, deps=_NO_DEPS[:], transfer_tasks=tasks[layer])
                    recv_items.append(rec)
                    by_index[base + layer] = rec
                    sig = rq_sig + len(recv_items) - 1
                    times[sig] = now  # fire: only a parked waiter needs the heap
                    if sig in waiters:
                        fire(sig, now)
                if wait_for[c]:
                    t0 = now
                    t = yield i
                    if t > now:
                        now = t
                    consumer_wait += now - t0
                    by_index[i].stages.append((consumer, t0, now))  # type: ignore[union-attr]
                elif release_on_forward:
                    now += slot_release[i]
                # attention: the gate's NPU event is recorded at attention start (first record wins)
                now += late_gate[i]
                point = tail if tail > now else now
                gate_npu[i] = point
                sig = gate_sig + i
                times[sig] = now  # fire: only a parked waiter needs the heap
                if sig in waiters:
                    fire(sig, now)
                tail = point + attention[i]
                # save_kv_layer(c): record the save event after attention, hand the save over
                save_npu[i] = tail
                if has:
                    srec = TaskRecord(sq, send_kind, len(send_items), step, c, False, None, None,
                                      0, 0, now, deps=_NO_DEPS[:])
                    send_items.append(srec)
                    sig = sq_sig + len(send_items) - 1
                    times[sig] = now  # fire: only a parked waiter needs the heap
                    if sig in waiters:
                        fire(sig, now)
                else:
                    sig = save_sig + i
                    times[sig] = now  # fire: only a parked waiter needs the heap
                    if sig in waiters:
                        fire(sig, now)
                tail += compute[i]
                now += host[i]
            t = yield save_sig + base + last
            if t > now:
                now = t
            self.steps.append(StepOutcome(step, step_start, now, consumer_wait))

    # -- recv thread ---------------------------------------------------------------------------------
    def _recv(self) -> Generator[int, int, None]:
        cfg, plan, loop = self.cfg, self.plan, self.loop
        fire, times, waiters = loop.fire, loop.times, loop.waiters
        n = cfg.num_layers
        total = self.total
        save_sig, gate_sig, rq_sig = total, 2 * total, 3 * total
        gva = cfg.path == "gva"
        main = cfg.behaviour == "main"
        npu_sync = main and gva
        waiter = plan.has_slot_release_waiter
        items = self.recv_items
        gate_npu, save_npu = self.gate_npu, self.save_npu
        meta, stagger, slot_release, load_copy = plan.meta_build, plan.stagger, plan.slot_release, plan.load_copy
        lease_ns = int(cfg.timing.copy_call_us * 500)  # batch_remove_lease: half a copy call
        s_cpu, s_npu, g_cond, g_npu = Stage.SAVE_CPU_WAIT, Stage.SAVE_NPU_SYNC, Stage.GATE_COND_WAIT, Stage.GATE_NPU_SYNC
        s_meta, s_stag, s_slot, s_back = Stage.META_BUILD, Stage.H2D_STAGGER, Stage.SLOT_RELEASE_WAIT, Stage.BACKEND_SUBMIT
        copies = self.copies
        now = 0
        tail = 0  # h2d stream
        k = 0
        while True:
            t = yield rq_sig + k
            rec = items[k]
            k += 1
            if t > now:
                now = t
            rec.t_dequeue = now
            layer = rec.layer_id
            step = rec.step
            i = step * n + layer
            has = bool(rec.transfer_tasks)
            stages = rec.stages
            deps = rec.deps
            src = rec.wait_for_save_layer
            if src is not None and (main or not has):  # main: the save wait comes first
                s = step * n + src
                t0 = now
                t = yield save_sig + s
                if t > now:
                    now = t
                stages.append((s_cpu, t0, now))
                deps[0] = deps[1] = t
                rec.has_dep |= 1 << Dep.SAVE_CPU
                if npu_sync:
                    sn = save_npu[s]
                    t0 = now
                    if sn > now:
                        now = sn
                    stages.append((s_npu, t0, now))
                    deps[2] = deps[3] = sn
                    rec.has_dep |= 1 << Dep.SAVE_NPU
            if not has:
                if waiter:
                    end = now + slot_release[i]
                    stages.append((s_slot, now, end))
                    deps[8] = deps[9] = now = end
                    rec.has_dep |= 1 << Dep.SLOT_RELEASE
                rec.outcome = Outcome.EMPTY
                rec.t_complete = now
                sig = i
                times[sig] = now  # fire: only a parked waiter needs the heap
                if sig in waiters:
                    fire(sig, now)
                continue
            if gva:
                stages.append((s_meta, now, now + meta[i]))
                now += meta[i]
            gate = rec.gate_id
            if gate is not None:
                g = step * n + gate
                t0 = now
                t = yield gate_sig + g
                if t > now:  # a condition wait only when the record had not happened yet
                    now = t
                    stages.append((g_cond, t0, now))
                gn = gate_npu[g]
                deps[4] = deps[5] = t
                deps[6] = deps[7] = gn
                rec.has_dep |= (1 << Dep.GATE_RECORD) | (1 << Dep.GATE_NPU)
                t0 = now
                if gn > now:
                    now = gn
                stages.append((g_npu, t0, now))
            if not gva:
                stages.append((s_meta, now, now + meta[i]))
                now += meta[i]
            else:
                stages.append((s_stag, now, now + stagger[i]))  # recorded also as a no-op, like the instrumentation
                now += stagger[i]
                if waiter:
                    end = now + slot_release[i]
                    stages.append((s_slot, now, end))
                    deps[8] = deps[9] = now = end
                    rec.has_dep |= 1 << Dep.SLOT_RELEASE
            t0 = now
            if tail > now:
                now = tail
            now = tail = now + load_copy[i]
            stages.append((s_back, t0, now))
            copies.append((step, layer, t0, now))
            rec.t_backend_return = now
            rec.nbytes = plan.load_blocks[i] * BLOCK_BYTES
            if i == plan.fail_index and gva:
                rec.backend_result = 1
                if main:  # the thread dies: no load event, no task_done, later tasks stay queued
                    rec.outcome = Outcome.ERROR
                    rec.error = RuntimeError(f"batch_copy failed for layer {layer} (result 1)")
                    rec.t_complete = now
                    self.error = f"recv thread died at step {step} layer {layer}: {rec.error}"
                    return
            if layer == n - 1:
                now += lease_ns
                self.lease_release[step] = now
            rec.t_complete = now
            sig = i
            times[sig] = now  # fire: only a parked waiter needs the heap
            if sig in waiters:
                fire(sig, now)

    # -- send thread ---------------------------------------------------------------------------------
    def _send(self) -> Generator[int, int, None]:
        plan, loop = self.plan, self.loop
        fire, times, waiters = loop.fire, loop.times, loop.waiters
        n = self.cfg.num_layers
        total = self.total
        save_sig, sq_sig = total, 4 * total + 1
        items = self.send_items
        save_npu, save_copy, blocks, meta = self.save_npu, plan.save_copy, plan.blocks, plan.meta_build
        s_npu, s_back = Stage.SAVE_NPU_SYNC, Stage.BACKEND_SUBMIT
        now = 0
        tail = 0  # d2h stream
        k = 0
        while True:
            t = yield sq_sig + k
            rec = items[k]
            k += 1
            if t > now:
                now = t
            rec.t_dequeue = now
            i = rec.step * n + rec.layer_id
            now += meta[i]  # the send thread's own build_addrs (not a traced stage)
            sn = save_npu[i]
            t0 = now
            if sn > now:
                now = sn
            rec.stages.append((s_npu, t0, now))  # like the instrumentation: a stage, no dependency record
            t0 = now
            if tail > now:
                now = tail
            now = tail = now + save_copy[i]
            rec.stages.append((s_back, t0, now))
            rec.t_backend_return = rec.t_complete = now
            rec.nbytes = blocks[rec.step] * BLOCK_BYTES
            sig = save_sig + i
            times[sig] = now  # fire: only a parked waiter needs the heap
            if sig in waiters:
                fire(sig, now)


def _fill_depths(records: list[TaskRecord]) -> None:
    """``queue_depth_at_enqueue`` / ``inflight_at_enqueue`` from FIFO dequeue and completion times.

    In one FIFO, dequeue and completion times are non-decreasing in ``seq``, so two pointers suffice.
    A task never dequeued (or never completed, e.g. after a fatal error) counts as still queued.
    """
    never = 1 << 62
    error = Outcome.ERROR
    deq_t = [r.t_dequeue if r.t_dequeue >= 0 else never for r in records]
    done_t = [r.t_complete if r.t_complete >= 0 and r.outcome != error else never for r in records]
    deq = done = 0
    for idx, rec in enumerate(records):
        t = rec.t_enqueue
        while deq < idx and deq_t[deq] <= t:
            deq += 1
        while done < idx and done_t[done] <= t:
            done += 1
        rec.queue_depth_at_enqueue = idx - deq
        rec.inflight_at_enqueue = idx - done


class _KeepRecordsRecorder(Recorder):
    """A recorder that never recycles: the exported records are the ``SimResult``'s, kept intact."""

    def recycle(self, records: list[TaskRecord]) -> None:
        return None


def simulate_to_recorder(cfg: ReplicaConfig, recorder: Recorder | None = None, *, run_id: str | None = None,
                         epoch_ns: int = DEFAULT_EPOCH_NS) -> tuple[SimResult, Recorder]:
    """Simulate and submit every record to a recorder anchored at ``epoch_ns`` (virtual time 0)."""
    result = simulate(cfg, run_id=run_id)
    if recorder is None:
        clock = VirtualClock(result.end_ns)
        recorder = _KeepRecordsRecorder(
            capacity=max(1, result.num_tasks), clock=clock.now_ns, anchor=ClockAnchor(0, epoch_ns))
    for rec in result.recv:
        recorder.submit(rec)
    for rec in result.send:
        recorder.submit(rec)
    return result, recorder


def simulate_to_traces(
    cfg: ReplicaConfig,
    out_dir: str | Path = "kvtrace-data",
    *,
    run_id: str | None = None,
    epoch_ns: int | None = None,
    timeout_s: float = 300.0,
) -> tuple[SimResult, Path]:
    """Simulate, then write every record through the package exporter as OTLP/JSON lines.

    The file is ``{out_dir}/traces/kvtrace-{run_id}-{pid}.jsonl`` (schema.md "Files"); the resource
    carries ``cfg.resource_attributes()`` and ``kvtrace.run_id``. Virtual time 0 maps to ``epoch_ns``
    (default: now). Returns the result and the file written.
    """
    from otel_kvtrace.export.sinks import JsonLinesFileSink  # deferred: pulls in the OTel SDK
    from otel_kvtrace.export.worker import BackgroundExporter, build_resource

    run = run_id or f"replica-sim-s{cfg.seed}-{time.time_ns() // 1_000_000}"
    result, recorder = simulate_to_recorder(
        cfg, run_id=run, epoch_ns=epoch_ns if epoch_ns is not None else time.time_ns())
    resource = dict(cfg.resource_attributes())
    resource["kvtrace.run_id"] = run
    sink = JsonLinesFileSink(Path(out_dir), run, build_resource(resource))
    exporter = BackgroundExporter(recorder, sink)
    if not exporter.shutdown(timeout_s):
        raise TimeoutError(f"exporting {result.num_tasks} records took longer than timeout_s={timeout_s}")
    return result, sink.path
