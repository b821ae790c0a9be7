"""Virtual-clock engine: documented orderings, HOL evidence and the pipeline's hard invariants."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from otel_kvtrace.record.model import NO_TIME, Dep, Outcome, Stage, TaskKind, stage_triples
from otel_kvtrace.replica.config import ReplicaConfig, SlowInjection, Timing
from otel_kvtrace.replica.events import Actor, EventLoop
from otel_kvtrace.replica.layout import build_layout
from otel_kvtrace.replica.simulate import ready_time, simulate, simulate_to_traces

HOL_CFG = ReplicaConfig(
    num_layers=8, num_shared_buffers=2, prefetch_layers=4, independent_layers=(0, 4), steps=2,
    slow=SlowInjection(slow_save_layers=(1,), slow_save_us=4000),
)


def _stage(rec, stage: Stage) -> tuple[int, int] | None:
    for s, a, b in stage_triples(rec.stages):
        if s == stage:
            return a, b
    return None


def test_event_loop_orders_by_time_then_push_order() -> None:
    loop = EventLoop(num_signals=3)
    seen: list[str] = []

    def actor(name: str, sig: int):
        t = yield sig
        seen.append(f"{name}@{t}")

    for name, sig in (("a", 0), ("b", 1), ("c", 2)):
        loop.start(Actor(name, actor(name, sig)))
    loop.run()  # all three park on unfired signals
    loop.fire(2, 5)
    loop.fire(0, 7)
    loop.fire(1, 5)
    loop.run()
    assert seen == ["c@5", "b@5", "a@7"]  # equal times: push (seq) order


def test_documented_enqueue_order_main() -> None:
    res = simulate(ReplicaConfig(num_layers=6, num_shared_buffers=2, prefetch_layers=3, steps=2))
    got = [(r.step, r.layer_id, r.wait_for_save_layer, r.gate_id) for r in res.recv]
    one = [(0, None, None), (1, None, 0), (2, None, 0), (3, 1, 1), (4, 2, 2), (5, 3, 3)]
    assert got == [(0, *t) for t in one] + [(1, *t) for t in one]
    assert [r.seq for r in res.recv] == list(range(12))
    # enqueue times: layers 0-2 together at the step start, then one per forward layer, in order
    t = [r.t_enqueue for r in res.recv[:6]]
    assert t[0] == t[1] == t[2] < t[3] < t[4] < t[5]


def test_independent_task_is_ready_while_the_head_waits_for_a_save() -> None:
    res = simulate(HOL_CFG)
    step0 = {r.layer_id: r for r in res.recv if r.step == 0}
    head, behind = step0[3], step0[4]
    assert (head.wait_for_save_layer, behind.wait_for_save_layer, behind.gate_id) == (1, None, 1)
    wait = _stage(head, Stage.SAVE_CPU_WAIT)
    assert wait is not None
    # T4 was enqueued and ready (gate G1 opened on the device) while T3 still waited for save(1) ...
    assert behind.t_enqueue < wait[1] and ready_time(behind) < wait[1]
    # ... and FIFO made it wait: dequeued only after the head finished
    assert behind.t_dequeue >= head.t_complete > ready_time(behind)


WAIT_STAGES = (Stage.SAVE_CPU_WAIT, Stage.SAVE_NPU_SYNC, Stage.GATE_COND_WAIT, Stage.GATE_NPU_SYNC,
               Stage.SLOT_RELEASE_WAIT)


def _ready_behind_waiting_head(res) -> list[tuple[int, int, int]]:
    """(step, head layer, ready layer) for every later, non-final task ready while the head waited."""
    found = []
    for i, head in enumerate(res.recv):
        for stage in WAIT_STAGES:
            span = _stage(head, stage)
            if span is None or span[1] <= span[0]:
                continue
            for later in res.recv[i + 1:]:
                if later.step == head.step and not later.final_layer and ready_time(later) < span[1]:
                    found.append((head.step, head.layer_id, later.layer_id))
    return sorted(set(found))


def test_uniform_layout_has_no_ready_task_behind_a_waiting_head() -> None:
    res = simulate(ReplicaConfig(num_layers=8, num_shared_buffers=2, prefetch_layers=4, steps=3))
    assert _ready_behind_waiting_head(res) == []
    slow = ReplicaConfig(num_layers=12, num_shared_buffers=2, prefetch_layers=4, steps=2,
                         slow=SlowInjection(slow_save_layers=(4,), slow_save_us=3000))
    assert _ready_behind_waiting_head(simulate(slow)) == []  # one bucket: a slow save delays everyone behind


def test_multi_bucket_layout_makes_readiness_non_monotone() -> None:
    # buckets a = [1,3,4,6,7,9,10], b = [2,5,8,11]; chains differ in distance, so a slow save(4) holds
    # T7 (src 4) at the head while T8 (src 2, other bucket) is ready (research §3, case 2)
    cfg = ReplicaConfig(num_layers=12, num_shared_buffers=2, prefetch_layers=4, bucket_pattern="aab", steps=2,
                        slow=SlowInjection(slow_save_layers=(4,), slow_save_us=3000))
    assert build_layout(cfg).prefetch_layer_map[7] == 4 and build_layout(cfg).prefetch_layer_map[8] == 2
    found = _ready_behind_waiting_head(simulate(cfg))
    assert (0, 7, 8) in found and (1, 7, 8) in found


def _check_invariants(cfg: ReplicaConfig) -> None:
    res = simulate(cfg)
    assert res.error is None
    lay = build_layout(cfg)
    saves = {(s.step, s.layer_id): s for s in res.send}
    n = cfg.num_layers
    copies_by_step: dict[int, list[tuple[int, int]]] = {}
    for step, _layer, a, b in res.copy_intervals:
        copies_by_step.setdefault(step, []).append((a, b))
    prev_complete = -1
    for rec in res.recv:
        assert rec.t_enqueue <= rec.t_dequeue <= rec.t_complete
        assert rec.t_dequeue >= prev_complete  # one FIFO, served in order
        prev_complete = rec.t_complete
        copy = _stage(rec, Stage.BACKEND_SUBMIT)
        src = rec.wait_for_save_layer
        if cfg.behaviour == "main" and cfg.path == "gva":
            assert src == lay.prefetch_layer_map.get(rec.layer_id)
        if src is not None:
            # save-before-reuse: the buffer's previous occupant is saved (CPU flag and device point) first
            save = saves.get((rec.step, src))
            done = save.t_complete if save is not None else rec.dep_hi(Dep.SAVE_CPU)
            assert rec.dep_hi(Dep.SAVE_CPU) == done
            write_start = copy[0] if copy else rec.t_complete
            assert write_start >= done and write_start >= rec.dep_hi(Dep.SAVE_NPU)
        if rec.gate_id is not None:
            # attention boundary: no copy before the device reached attention of the gate's layer
            assert rec.gate_id < rec.layer_id
            assert copy[0] >= rec.dep_hi(Dep.GATE_NPU) >= rec.dep_hi(Dep.GATE_RECORD)
        if copy and rec.outcome == Outcome.OK:
            assert rec.t_complete >= copy[1]
    # only the GVA path releases leases (upstream's key-path recv thread never calls batch_remove_lease)
    final_loads = {r.step for r in res.recv if r.final_layer and r.transfer_tasks and res.config.path == "gva"}
    for st_ in res.steps:
        if st_.step in final_loads:
            # final-layer lease release after every copy of the step
            assert st_.lease_release_ns >= max(b for _a, b in copies_by_step[st_.step])
        else:
            # as upstream: only the final layer's GVA load task releases leases; without one, nobody does
            assert st_.lease_release_ns == NO_TIME
    # the forward's consumer wait of each layer ends when that layer's load is complete
    for rec in res.recv:
        cw = _stage(rec, Stage.CONSUMER_WAIT)
        if cw is not None:
            assert cw[1] >= rec.t_complete
    for s in res.send:
        assert s.kind == TaskKind.SEND and s.t_complete >= s.dep_hi(Dep.SAVE_NPU)
    from otel_kvtrace.replica.plan import build_plan

    plan = build_plan(cfg)
    main = cfg.behaviour == "main"
    expected = sum(1 for step in range(cfg.steps) for layer, has in enumerate(plan.load_pattern(step))
                   if has or (main and layer in lay.prefetch_layer_map))
    assert len(res.recv) == expected
    for rec in res.recv:
        assert rec.nbytes == (plan.load_blocks[rec.step * n + rec.layer_id] * 4096 if rec.transfer_tasks else 0)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    n=st.integers(2, 16),
    b=st.integers(1, 8),
    p=st.integers(1, 8),
    indep=st.lists(st.integers(0, 15), max_size=3),
    behaviour=st.sampled_from(["main", "v0.23"]),
    path=st.sampled_from(["gva", "key"]),
    jitter=st.sampled_from(["none", "uniform", "lognormal", "exponential"]),
    slow=st.integers(0, 15),
    release=st.sampled_from([0.0, 300.0]),
    requests=st.integers(0, 3),
    seed=st.integers(0, 5),
    fraction=st.sampled_from([1.0, 0.5, 0.0]),
)
def test_invariants_hold_for_any_config(n, b, p, indep, behaviour, path, jitter, slow, release, requests, seed,
                                        fraction) -> None:
    cfg = ReplicaConfig(
        behaviour=behaviour, path=path, num_layers=n, num_shared_buffers=b, prefetch_layers=p,
        independent_layers=tuple(x for x in indep if x < n) or (0,), requests_per_step=requests, steps=3, seed=seed,
        timing=Timing(jitter=jitter, slot_release_us=release, independent_load_fraction=fraction),
        slow=SlowInjection(slow_save_layers=(slow % n,), slow_save_us=2000, late_gate_layers=(0,), late_gate_us=500),
    )
    _check_invariants(cfg)


def test_empty_reuse_tasks_still_wait_for_the_save() -> None:
    res = simulate(ReplicaConfig(num_layers=6, num_shared_buffers=2, prefetch_layers=3, requests_per_step=0, steps=1))
    assert [(r.layer_id, r.wait_for_save_layer, r.gate_id, r.outcome) for r in res.recv] == [
        (3, 1, None, Outcome.EMPTY), (4, 2, None, Outcome.EMPTY), (5, 3, None, Outcome.EMPTY)]
    assert all(_stage(r, Stage.SAVE_NPU_SYNC) is not None for r in res.recv)
    assert res.send == []


def test_deterministic_for_a_seed() -> None:
    cfg = HOL_CFG.with_(timing=Timing(jitter="lognormal"), seed=3, steps=4)
    a, b = simulate(cfg), simulate(cfg)
    def key(r):
        return (r.seq, r.t_enqueue, r.t_dequeue, r.t_complete, tuple(r.stages), tuple(r.deps))
    assert [key(r) for r in a.recv] == [key(r) for r in b.recv]
    c = simulate(cfg.with_(seed=4))
    assert [key(r) for r in a.recv] != [key(r) for r in c.recv]


def test_queue_depth_counts_tasks_not_yet_dequeued() -> None:
    res = simulate(HOL_CFG.with_(steps=1))
    for rec in res.recv:
        expected = sum(1 for o in res.recv if o.seq < rec.seq and o.t_dequeue > rec.t_enqueue)
        assert rec.queue_depth_at_enqueue == expected
        inflight = sum(1 for o in res.recv if o.seq < rec.seq and o.t_complete > rec.t_enqueue)
        assert rec.inflight_at_enqueue == inflight
    assert max(r.queue_depth_at_enqueue for r in res.recv) > 0


def test_main_copy_failure_kills_the_recv_thread() -> None:
    res = simulate(ReplicaConfig(steps=3, slow=SlowInjection(fail_copy_at=(1, 3))))
    assert res.error and "step 1 layer 3" in res.error
    failed = [r for r in res.recv if r.outcome == Outcome.ERROR]
    assert [(r.step, r.layer_id) for r in failed] == [(1, 3)]
    later = [r for r in res.recv if (r.step, r.layer_id) > (1, 3)]
    assert later and all(r.t_dequeue == NO_TIME for r in later)  # still queued: the thread is gone
    assert len(res.steps) == 1  # the forward never finished step 1


def test_v023_copy_failure_is_logged_and_processing_continues() -> None:
    res = simulate(ReplicaConfig(behaviour="v0.23", steps=3, slow=SlowInjection(fail_copy_at=(1, 3))))
    assert res.error is None and len(res.steps) == 3
    bad = [r for r in res.recv if r.backend_result != 0]
    # logged and not raised, yet an error task, as the instrumentation records it (BackendResultError)
    assert [(r.step, r.layer_id, r.outcome) for r in bad] == [(1, 3, Outcome.ERROR)]


def test_simulate_to_traces_writes_the_hol_evidence(tmp_path) -> None:
    result, path = simulate_to_traces(HOL_CFG.with_(steps=1), tmp_path, run_id="sim-hol", epoch_ns=10**18)
    lines = path.read_bytes().splitlines()
    roots = {}
    resources = []
    for line in lines:
        for rs in orjson.loads(line)["resourceSpans"]:
            resources.append({a["key"]: a["value"] for a in rs["resource"]["attributes"]})
            for ss in rs["scopeSpans"]:
                for span in ss["spans"]:
                    if span["name"] == "kvtrace.recv.task":
                        attrs = {a["key"]: next(iter(a["value"].values())) for a in span["attributes"]}
                        roots[int(attrs["kvtrace.layer_id"])] = attrs
    assert len(roots) == len(result.recv) == 8
    assert resources[0]["kvtrace.cfg.label"]["stringValue"] == HOL_CFG.label
    assert resources[0]["kvtrace.source"]["stringValue"] == "replica"
    t3, t4 = roots[3], roots[4]
    assert int(t3["kvtrace.wait_for_save_layer"]) == 1
    # in the exported trace, T4 is ready before the head T3 completes, yet dequeued after it
    assert int(t4["kvtrace.ts.ready"]) < int(t3["kvtrace.ts.complete"]) <= int(t4["kvtrace.ts.dequeue"])
    assert int(t4["kvtrace.ts.enqueue"]) == 10**18 + result.recv[4].t_enqueue  # virtual 0 -> epoch_ns
    assert result.recv[4].layer_id == 4 and result.recv[4].stages  # the result survives the export


@pytest.mark.parametrize("cfg", [HOL_CFG, HOL_CFG.with_(behaviour="v0.23"), HOL_CFG.with_(path="key")])
def test_records_have_consistent_stage_order(cfg: ReplicaConfig) -> None:
    res = simulate(cfg)
    for rec in res.recv:
        ends = [(a, b) for s, a, b in stage_triples(rec.stages) if s != Stage.CONSUMER_WAIT]
        assert all(a <= b for a, b in ends)
        assert all(ends[i][1] <= ends[i + 1][0] for i in range(len(ends) - 1))  # one thread, sequential


def test_no_lease_release_when_the_final_layer_has_nothing_to_load() -> None:
    """Upstream hazard the replica keeps: only the final layer's load task releases the step's leases."""
    cfg = ReplicaConfig(num_layers=6, num_shared_buffers=2, independent_layers=(0, -1), steps=2,
                        timing=Timing(independent_load_fraction=0.0))
    res = simulate(cfg)
    assert all(r.layer_id != 5 for r in res.recv)  # layer 5: independent, nothing uncached, not submitted
    assert [s.lease_release_ns for s in res.steps] == [NO_TIME, NO_TIME]
    assert all(s.lease_release_ns != NO_TIME for s in simulate(cfg.with_(independent_layers=(0,))).steps)


def test_late_gate_shows_as_condition_wait_of_the_gated_task() -> None:
    cfg = ReplicaConfig(num_layers=6, num_shared_buffers=6, prefetch_layers=3, steps=1,
                        slow=SlowInjection(late_gate_layers=(1,), late_gate_us=2000))
    res = simulate(cfg)
    gated = [r for r in res.recv if r.gate_id == 1]
    assert [r.layer_id for r in gated] == [3]
    cond = _stage(gated[0], Stage.GATE_COND_WAIT)
    assert cond is not None and cond[1] == gated[0].dep_hi(Dep.GATE_RECORD)  # waited until the record
    baseline = next(r for r in simulate(cfg.with_(slow=SlowInjection())).recv if r.gate_id == 1)
    assert _stage(baseline, Stage.GATE_COND_WAIT) is None
    # the forward recorded G1 exactly 2 ms later than without the injection
    assert gated[0].dep_hi(Dep.GATE_RECORD) - baseline.dep_hi(Dep.GATE_RECORD) == 2_000_000


def test_slow_slot_release_is_an_absolute_time_and_leaves_later_tasks_ready() -> None:
    cfg = ReplicaConfig(num_layers=8, num_shared_buffers=2, prefetch_layers=4, steps=2,
                        slow=SlowInjection(slow_slot_release_layers=(3,), slow_slot_release_us=3000))
    res = simulate(cfg)
    for outcome in res.steps:
        by_layer = {r.layer_id: r for r in res.recv if r.step == outcome.step}
        head, behind = by_layer[3], by_layer[4]
        release_at = outcome.start_ns + 3_000_000
        assert head.dep_hi(Dep.SLOT_RELEASE) == release_at  # producer-side time, known before the call
        wait = _stage(head, Stage.SLOT_RELEASE_WAIT)
        assert wait is not None and wait[1] == release_at > wait[0]
        # T4's slot was free at the step start, its save and gate too before T3's slot: ready behind the head
        assert behind.dep_hi(Dep.SLOT_RELEASE) == outcome.start_ns
        assert ready_time(behind) < wait[1] <= behind.t_dequeue
