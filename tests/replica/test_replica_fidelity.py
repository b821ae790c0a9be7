"""Fidelity to upstream points a reviewer checked against the real sources (0.23.0.post1 and main)."""

from __future__ import annotations

import pytest

from otel_kvtrace.api import start_tracing
from otel_kvtrace.record.model import NO_TIME, Outcome, TaskKind
from otel_kvtrace.replica.config import ReplicaConfig, SlowInjection, Timing
from otel_kvtrace.replica.layout import build_layout
from otel_kvtrace.replica.plan import build_plan
from otel_kvtrace.replica.simulate import simulate
from otel_kvtrace.replica.threaded import replica_targets, run_threaded

KEY = ReplicaConfig(path="key", num_layers=4, prefetch_layers=2, steps=2)


def _traced_recv(cfg: ReplicaConfig, run_id: str) -> dict[tuple[int, int], object]:
    session = start_tracing(replica_targets(cfg.behaviour), exporter=None, npu_timing=True, run_id=run_id)
    try:
        assert run_threaded(cfg).error is None
    finally:
        session.shutdown()
    return {(r.step, r.layer_id): r for r in session.recorder.drain(100_000) if r.kind == TaskKind.RECV}


def test_key_path_never_releases_leases_in_either_engine() -> None:
    """Upstream's ``KVCacheStoreKeyLayerRecvingThread`` has no ``batch_remove_lease`` call."""
    assert run_threaded(KEY).lease_releases == []
    res = simulate(KEY)
    assert [s.lease_release_ns for s in res.steps] == [NO_TIME] * KEY.steps
    final = [r for r in res.recv if r.final_layer]
    assert final and all(r.t_complete == r.t_backend_return for r in final)
    # the GVA path still releases them once per step, after the final layer's copy
    gva = simulate(KEY.with_(path="gva"))
    assert all(s.lease_release_ns > 0 for s in gva.steps)


@pytest.mark.parametrize("base", [KEY, KEY.with_(behaviour="v0.23"), KEY.with_(behaviour="v0.23", path="gva")],
                         ids=["key-main", "key-v0.23", "gva-v0.23"])
def test_failed_load_that_does_not_kill_the_thread_is_recorded_like_the_instrumentation(base) -> None:
    """The thread logs a non-zero copy/``get`` result and goes on; the traced record keeps the code
    (``backend_result``) and marks the task an error (``BackendResultError``)."""
    cfg = base.with_(slow=SlowInjection(fail_copy_at=(1, 2)))
    traced = _traced_recv(cfg, f"t-fail-{cfg.behaviour}-{cfg.path}")
    res = simulate(cfg)
    assert res.error is None
    virtual = {(r.step, r.layer_id): r for r in res.recv}
    assert traced[(1, 2)].backend_result == 1
    got = {k: (r.backend_result, int(r.outcome)) for k, r in virtual.items()}
    want = {k: (r.backend_result, int(r.outcome)) for k, r in traced.items()}
    assert got == want
    assert virtual[(1, 2)].outcome == Outcome.ERROR
    assert type(virtual[(1, 2)].error) is type(traced[(1, 2)].error)


@pytest.mark.parametrize(
    "cfg",
    [
        ReplicaConfig(num_layers=6, independent_layers=(0, 3)),  # B defaults to N: nothing is shared
        ReplicaConfig(num_layers=6, num_shared_buffers=4, independent_layers=(0, 3)),  # 4 reused, 4 slots
        ReplicaConfig(behaviour="v0.23", num_layers=6, independent_layers=(0, 3)),
        ReplicaConfig(path="key", num_layers=6, independent_layers=(0, 3)),
    ],
    ids=["B=N", "B=reused", "v0.23", "key"],
)
def test_without_real_buffer_sharing_every_layer_loads_the_same_uncached_tail(cfg: ReplicaConfig) -> None:
    """Upstream starts a load at vLLM's cached tokens `if not layerwise_offload or layer_id in
    independent_layers`; layerwise_offload is the layout's has_layer_reuse, false here."""
    cfg = cfg.with_(steps=1, requests_per_step=2, timing=Timing(blocks_per_request=8, independent_load_fraction=0.25))
    assert not build_layout(cfg).has_layer_reuse
    plan = build_plan(cfg)
    assert plan.load_blocks == [4] * 6
    ranges = {tuple((r.start_block, r.end_block) for r in rec.transfer_tasks[0].block_ranges)
              for rec in simulate(cfg).recv}
    assert ranges == {((6, 8), (6, 8))}


@pytest.mark.parametrize("independent", [(0, 4), (2, 5)], ids=["tail-first", "full-first"])
def test_every_gva_load_of_a_step_copies_the_one_shared_block_list(independent: tuple[int, ...]) -> None:
    """Upstream's ``_build_shared_load_data`` builds one ``SharedBlockData`` per group and step from the first
    layer with a load task and attaches it to every load task; the recv thread copies only that list. With
    reuse, independent layers' own ranges are the uncached tail, yet every layer copies the first one's."""
    cfg = ReplicaConfig(num_layers=8, num_shared_buffers=2, prefetch_layers=4, independent_layers=independent,
                        requests_per_step=2, steps=2, timing=Timing(blocks_per_request=8, independent_load_fraction=0.25))
    assert build_layout(cfg).has_layer_reuse
    first_blocks = 4 if 0 in independent else 16  # layer 0 loads the tail (2 requests x 2) or the whole chunk
    traced = _traced_recv(cfg, f"t-shared-{independent}")
    res = simulate(cfg)
    virtual = {(r.step, r.layer_id): r for r in res.recv}
    assert {k: r.nbytes for k, r in traced.items()} == {k: r.nbytes for k, r in virtual.items()}
    assert {r.nbytes for r in virtual.values()} == {first_blocks * 4096}
    # the tasks keep their own ranges (upstream's LayerTransferTask.block_ranges); only the copy is shared
    own = {layer: sum(b.end_block - b.start_block for b in virtual[(0, layer)].transfer_tasks[0].block_ranges)
           for layer in range(8)}
    assert {own[layer] for layer in independent} == {4} and own[1] == 16
