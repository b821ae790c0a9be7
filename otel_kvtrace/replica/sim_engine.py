"""The virtual engine's actors: the forward and recv threads as generators (see ``events.py``).

The send thread needs no actor: it waits only on its FIFO and on the save point of the layer it saves,
both known when the forward enqueues the save, so the forward computes the save task's timeline on the
spot (start, its own ``build_addrs``, NPU sync, D2H copy, ``save_finished`` set) and fires the save signal
with that future time.

The actors follow the same rules as the threaded replica (``layout.py`` for submissions, the research
notes for each thread's order of waits) and fill ``TaskRecord``s the way the instrumentation fills them
on real threads. Device work uses the fake NPU's stream arithmetic inline: a kernel starts at
``max(now, stream tail)``; an event recorded now completes at the tail.

The actor loops are the simulator's hot path: they use ``if t > now: now = t`` rather than ``max()``,
read already-fired signals directly instead of yielding, and append stages as flat triples.
"""

from __future__ import annotations

from collections.abc import Generator

from otel_kvtrace.record.model import NO_TIME, BackendResultError, Dep, Outcome, QueueInfo, Stage, TaskKind, TaskRecord
from otel_kvtrace.replica.config import ReplicaConfig
from otel_kvtrace.replica.events import Actor, EventLoop
from otel_kvtrace.replica.layout import build_layout, enqueue_plan, should_wait
from otel_kvtrace.replica.metadata import LayerTransferTask
from otel_kvtrace.replica.plan import WorkPlan, step_block_ranges
from otel_kvtrace.replica.sim_result import SimResult, StepOutcome, fill_depths

RECV_THREAD_NAMES = {"gva": "KVCacheStoreLayerRecvingThread", "key": "KVCacheStoreKeyLayerRecvingThread"}
SEND_THREAD_NAMES = {"gva": "KVCacheStoreLayerSendingThread", "key": "KVCacheStoreKeyLayerSendingThread"}
BLOCK_BYTES = 4096
"""Bytes per block the replica reports (a nominal page size; only ``bytes`` attributes use it)."""

_NO_DEPS = [NO_TIME] * (2 * len(Dep))


def _slot_release_wait(rec: TaskRecord, now: int, release_at: int) -> int:
    """The main GVA ``external_slot_release_waiter``: blocks until the sibling connector frees the slot at
    the absolute time ``release_at`` (empty and loading tasks alike); returns the recv thread's new now."""
    end = release_at if release_at > now else now
    rec.stages.extend((Stage.SLOT_RELEASE_WAIT, now, end))
    deps = rec.deps
    deps[8] = deps[9] = release_at
    rec.has_dep |= 1 << Dep.SLOT_RELEASE
    return end


class Simulation:
    """One run. Signals (indices into the loop's ``times``): load done, save done, gate recorded, one per
    (step, layer) each; then one per recv queue slot."""

    def __init__(self, cfg: ReplicaConfig, plan: WorkPlan, run_id: str, pid: int) -> None:
        self.cfg = cfg
        self.plan = plan
        self.layout = build_layout(cfg)
        total = cfg.steps * cfg.num_layers
        self.total = total
        # signal bases: load done at 0, then save done, gate recorded, recv queue slots (see the class docstring)
        self.save_sig, self.gate_sig, self.rq_sig = total, 2 * total, 3 * total
        self.loop = EventLoop(4 * total + 1)  # the recv queue's slots hold one extra (the never-filled next)
        self.gate_npu = [0] * total
        self.save_npu = [0] * total
        self.recv_items: list[TaskRecord] = []
        self.send_items: list[TaskRecord] = []
        self.by_index: list[TaskRecord | None] = [None] * total
        self.steps: list[StepOutcome] = []
        self.error: str | None = None
        self.copies: list[tuple[int, int, int, int]] = []
        self.lease_release: dict[int, int] = {}
        self.step_start = [0] * cfg.steps
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
        loop.start(Actor("forward", self._forward()))
        loop.start(Actor("recv", self._recv()))
        loop.run()
        if self.error is None and len(self.steps) < self.cfg.steps:  # cannot happen unless a rule is broken
            waiting = sorted(loop.waiters)
            self.error = f"stalled after {len(self.steps)} steps: actors wait on signals {waiting[:6]}"
        for outcome in self.steps:
            outcome.lease_release_ns = self.lease_release.get(outcome.step, NO_TIME)
        fill_depths(self.recv_items)
        fill_depths(self.send_items)
        return SimResult(
            self.cfg, self.layout, self.recv_items, self.send_items, self.steps, self.rq, self.sq,
            self.error, loop.events, self.copies,
        )

    # -- forward thread ------------------------------------------------------------------------------
    def _forward(self) -> Generator[int, int, None]:
        cfg, plan, loop = self.cfg, self.plan, self.loop
        fire, times, waiters = loop.fire, loop.times, loop.waiters
        n = cfg.num_layers
        save_sig, gate_sig, rq_sig = self.save_sig, self.gate_sig, self.rq_sig
        main = cfg.behaviour == "main"
        layout = self.layout
        waits = {
            pattern: [should_wait(cfg, layout, c, has) for c, has in enumerate(pattern)] for pattern in self.windows
        }
        release_on_forward = main and plan.has_slot_release_waiter
        # v0.23 and the key path: the recv thread clears the task list after its copy, so a forward that
        # arrives after the load finished sees no task (should_wait is false) and does not wait
        cleared_after_load = not main or cfg.path == "key"
        recv_items, send_items, by_index = self.recv_items, self.send_items, self.by_index
        gate_npu, save_npu = self.gate_npu, self.save_npu
        rq, sq = self.rq, self.sq
        attention, compute, host = plan.attention, plan.compute, plan.host_launch
        late_gate, slot_release = plan.late_gate, plan.slot_release
        recv_kind, send_kind, consumer = TaskKind.RECV, TaskKind.SEND, Stage.CONSUMER_WAIT
        meta, save_copy, blocks = plan.meta_build, plan.save_copy, plan.blocks
        s_npu, s_back = Stage.SAVE_NPU_SYNC, Stage.BACKEND_SUBMIT
        send_now = 0  # the send thread's clock
        d2h_tail = 0  # its copy stream
        last = n - 1
        now = 0
        tail = 0  # compute stream: device time when launched work finishes
        for step in range(cfg.steps):
            step_start = now
            self.step_start[step] = now
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
                    t = times[i]  # already fired: no round trip through the loop
                    if t < 0:
                        t = yield i
                    if not cleared_after_load or t > now:  # else: list already cleared, no wait and no stage
                        if t > now:
                            now = t
                        consumer_wait += now - t0
                        by_index[i].stages.extend((consumer, t0, now))  # type: ignore[union-attr]
                elif release_on_forward:
                    release_at = step_start + slot_release[i]
                    if release_at > now:
                        now = release_at
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
                    # The send thread waits only on its FIFO and on this save point, both known now, so its
                    # timeline is computed at enqueue: start, own build_addrs, NPU sync, D2H copy, set.
                    srec = TaskRecord(sq, send_kind, len(send_items), step, c, False, None, None,
                                      0, 0, now, deps=_NO_DEPS[:])
                    send_items.append(srec)
                    st = send_now if send_now > now else now
                    srec.t_dequeue = st
                    st += meta[i]
                    t0 = st
                    if tail > st:
                        st = tail
                    srec.stages.extend((s_npu, t0, st))  # like the instrumentation: a stage, no dependency
                    t0 = st
                    if d2h_tail > st:
                        st = d2h_tail
                    st = d2h_tail = send_now = st + save_copy[i]
                    srec.stages.extend((s_back, t0, st))
                    srec.t_backend_return = srec.t_complete = st
                    srec.nbytes = blocks[step] * BLOCK_BYTES
                    sig = save_sig + i
                    times[sig] = st  # fire: only a parked waiter needs the heap
                    if sig in waiters:
                        fire(sig, st)
                else:
                    sig = save_sig + i
                    times[sig] = now  # fire: only a parked waiter needs the heap
                    if sig in waiters:
                        fire(sig, now)
                tail += compute[i]
                now += host[i]
            t = times[save_sig + base + last]  # already fired: no round trip through the loop
            if t < 0:
                t = yield save_sig + base + last
            if t > now:
                now = t
            self.steps.append(StepOutcome(step, step_start, now, consumer_wait))

    # -- recv thread ---------------------------------------------------------------------------------
    def _recv(self) -> Generator[int, int, None]:
        cfg, plan, loop = self.cfg, self.plan, self.loop
        fire, times, waiters = loop.fire, loop.times, loop.waiters
        n = cfg.num_layers
        save_sig, gate_sig, rq_sig = self.save_sig, self.gate_sig, self.rq_sig
        gva = cfg.path == "gva"
        main = cfg.behaviour == "main"
        npu_sync = main and gva
        waiter = plan.has_slot_release_waiter
        items = self.recv_items
        gate_npu, save_npu = self.gate_npu, self.save_npu
        meta, stagger, slot_release, load_copy = plan.meta_build, plan.stagger, plan.slot_release, plan.load_copy
        step_start = self.step_start
        lease_ns = plan.lease_release_ns
        s_cpu, s_npu = Stage.SAVE_CPU_WAIT, Stage.SAVE_NPU_SYNC
        g_cond, g_npu = Stage.GATE_COND_WAIT, Stage.GATE_NPU_SYNC
        s_meta, s_stag = Stage.META_BUILD, Stage.H2D_STAGGER
        s_back = Stage.BACKEND_SUBMIT
        copies = self.copies
        now = 0
        tail = 0  # h2d stream
        k = 0
        while True:
            t = times[rq_sig + k]  # already fired: no round trip through the loop
            if t < 0:
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
                t = times[save_sig + s]  # already fired: no round trip through the loop
                if t < 0:
                    t = yield save_sig + s
                if t > now:
                    now = t
                stages.extend((s_cpu, t0, now))
                deps[0] = deps[1] = t
                rec.has_dep |= 1 << Dep.SAVE_CPU
                if npu_sync:
                    sn = save_npu[s]
                    t0 = now
                    if sn > now:
                        now = sn
                    stages.extend((s_npu, t0, now))
                    deps[2] = deps[3] = sn
                    rec.has_dep |= 1 << Dep.SAVE_NPU
            if not has:
                if waiter:
                    now = _slot_release_wait(rec, now, step_start[step] + slot_release[i])
                rec.outcome = Outcome.EMPTY
                rec.t_complete = now
                sig = i
                times[sig] = now  # fire: only a parked waiter needs the heap
                if sig in waiters:
                    fire(sig, now)
                continue
            if gva:
                stages.extend((s_meta, now, now + meta[i]))
                now += meta[i]
            gate = rec.gate_id
            if gate is not None:
                g = step * n + gate
                t0 = now
                t = times[gate_sig + g]  # already fired: no round trip through the loop
                if t < 0:
                    t = yield gate_sig + g
                if t > now:  # a condition wait only when the record had not happened yet
                    now = t
                    stages.extend((g_cond, t0, now))
                gn = gate_npu[g]
                deps[4] = deps[5] = t
                deps[6] = deps[7] = gn
                rec.has_dep |= (1 << Dep.GATE_RECORD) | (1 << Dep.GATE_NPU)
                t0 = now
                if gn > now:
                    now = gn
                stages.extend((g_npu, t0, now))
            if not gva:
                stages.extend((s_meta, now, now + meta[i]))
                now += meta[i]
            else:
                stages.extend((s_stag, now, now + stagger[i]))  # recorded also as a no-op, like the instrumentation
                now += stagger[i]
                if waiter:
                    now = _slot_release_wait(rec, now, step_start[step] + slot_release[i])
            t0 = now
            if tail > now:
                now = tail
            now = tail = now + load_copy[i]
            stages.extend((s_back, t0, now))
            copies.append((step, layer, t0, now))
            rec.t_backend_return = now
            rec.nbytes = plan.load_blocks[i] * BLOCK_BYTES
            if i == plan.fail_index:
                rec.backend_result = 1
                rec.outcome = Outcome.ERROR
                if main and gva:  # the thread dies: no load event, no task_done, later tasks stay queued
                    rec.error = RuntimeError(f"batch_copy failed for layer {layer} (result 1)")
                    rec.t_complete = now
                    self.error = f"recv thread died at step {step} layer {layer}: {rec.error}"
                    return
                # v0.23 GVA and the key path log the result code and go on (the instrumentation's record)
                rec.error = BackendResultError(1)
            if gva and layer == n - 1:  # only the GVA path releases leases (the key path never does)
                now += lease_ns
                self.lease_release[step] = now
            rec.t_complete = now
            sig = i
            times[sig] = now  # fire: only a parked waiter needs the heap
            if sig in waiters:
                fire(sig, now)
