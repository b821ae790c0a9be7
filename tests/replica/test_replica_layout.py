"""Layout and submission rules (research §2.2, §2.4), shared by both engines."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from otel_kvtrace.replica.config import ReplicaConfig
from otel_kvtrace.replica.layout import build_layout, enqueue_plan


def _plan(cfg: ReplicaConfig, has=None) -> list[list[tuple[int, int | None, int | None]]]:
    return [[(s.layer_id, s.wait_for_save_layer, s.gate_layer) for s in subs] for subs in enqueue_plan(cfg, has)]


def test_simple_layout_chains() -> None:
    lay = build_layout(ReplicaConfig(num_layers=6, num_shared_buffers=2))
    assert lay.prefetch_layer_map == {3: 1, 4: 2, 5: 3}
    assert lay.buffer_slots == ((0,), (1, 3, 5), (2, 4))
    assert lay.has_layer_reuse
    assert lay.storage_index(5) == 1


def test_independent_layers_not_a_prefix() -> None:
    lay = build_layout(ReplicaConfig(num_layers=8, num_shared_buffers=2, independent_layers=(0, 4)))
    assert lay.prefetch_layer_map == {3: 1, 5: 2, 6: 3, 7: 5}  # research §3, observed on CPU


def test_no_reuse_when_buffers_cover_the_reused_layers() -> None:
    assert build_layout(ReplicaConfig(num_layers=6, num_shared_buffers=5)).prefetch_layer_map == {}
    assert not build_layout(ReplicaConfig(num_layers=6)).has_layer_reuse  # default B = N
    assert build_layout(ReplicaConfig(num_layers=6, num_shared_buffers=2, buffer_reuse=False)).prefetch_layer_map == {}


def test_no_reuse_on_v023_and_key_path() -> None:
    for cfg in (ReplicaConfig(behaviour="v0.23", num_layers=6, num_shared_buffers=2),
                ReplicaConfig(path="key", num_layers=6, num_shared_buffers=2)):
        assert build_layout(cfg).prefetch_layer_map == {}


def test_multi_bucket_layout_has_per_bucket_chains() -> None:
    # kinds a,b alternate; bucket a = [2,4,6,8], bucket b = [1,3,5,7,9]; B=2 slots per bucket
    lay = build_layout(ReplicaConfig(num_layers=10, num_shared_buffers=2, bucket_pattern="ab"))
    assert lay.prefetch_layer_map == {6: 2, 8: 4, 5: 1, 7: 3, 9: 5}
    assert (2, 6) in lay.buffer_slots and (1, 5, 9) in lay.buffer_slots


def test_documented_main_ordering() -> None:
    # research §2.6: N=6, B=2, P=3 -> 0(None), 1(G0), 2(G0) then 3(src1,G1), 4(src2,G2), 5(src3,G3)
    plan = _plan(ReplicaConfig(num_layers=6, num_shared_buffers=2, prefetch_layers=3))
    assert plan == [
        [(0, None, None), (1, None, 0), (2, None, 0)],
        [(3, 1, 1)],
        [(4, 2, 2)],
        [(5, 3, 3)],
        [],
        [],
    ]


def test_prefetch_one_loads_synchronously_without_gates() -> None:
    plan = _plan(ReplicaConfig(behaviour="v0.23", num_layers=4))
    assert plan == [[(0, None, None)], [(1, None, None)], [(2, None, None)], [(3, None, None)]]


def test_window_skips_empty_layers_without_counting_them() -> None:
    cfg = ReplicaConfig(behaviour="v0.23", num_layers=6, prefetch_layers=2)
    plan = _plan(cfg, has=lambda layer: layer not in (1, 2))
    assert plan == [[(0, None, None), (3, None, 0)], [(4, None, 1)], [(5, None, 2)], [], [], []]


def test_main_empty_reuse_tasks_are_submitted_without_gate() -> None:
    cfg = ReplicaConfig(num_layers=6, num_shared_buffers=2, prefetch_layers=3)
    plan = _plan(cfg, has=lambda layer: False)
    # only reuse layers are submittable; they never get a gate; layer 3 fills the c=0 window alone
    assert plan == [[(3, 1, None), (4, 2, None), (5, 3, None)], [], [], [], [], []]


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    n=st.integers(1, 24),
    b=st.integers(1, 24),
    p=st.integers(1, 10),
    indep=st.lists(st.integers(0, 23), max_size=4),
    behaviour=st.sampled_from(["main", "v0.23"]),
    pattern=st.sampled_from([None, "ab", "aab"]),
)
def test_window_invariants(n: int, b: int, p: int, indep: list[int], behaviour: str, pattern: str | None) -> None:
    cfg = ReplicaConfig(behaviour=behaviour, num_layers=n, num_shared_buffers=b, prefetch_layers=p,
                        independent_layers=tuple(x for x in indep if x < n) or (0,), bucket_pattern=pattern)
    cfg.validate()
    lay = build_layout(cfg)
    mapping = lay.prefetch_layer_map
    assert len(set(mapping.values())) == len(mapping)  # injective: each source consumed once
    for layer, src in mapping.items():
        assert src < layer and lay.storage_index(src) == lay.storage_index(layer)
        assert layer not in cfg.resolved_independent and src not in cfg.resolved_independent
    plan = _plan(cfg)
    flat = [(c, *t) for c, subs in enumerate(plan) for t in subs]
    assert [t[1] for t in flat] == list(range(n))  # every layer once, in layer order
    for c, layer, src, gate in flat:
        assert layer >= c  # never submitted after its own forward layer
        assert gate is None if layer == c else gate == c
        assert src == (mapping.get(layer) if behaviour == "main" else None)
        # a task is always submitted no later than its own wait_for_layer_load
    assert all(len(subs) <= (p if c == 0 else 1) for c, subs in enumerate(plan))


def test_concurrent_requests_are_staggered_across_chunks() -> None:
    from otel_kvtrace.replica.plan import build_plan

    plan = build_plan(ReplicaConfig(requests_per_step=3, chunks_per_request=2, steps=3))
    got = [[(r.req_id, r.is_last_chunk) for r in batch] for batch in plan.requests]
    assert got == [
        [("req-0", False), ("req-1", True), ("req-5", False)],
        [("req-0", True), ("req-4", False), ("req-5", True)],
        [("req-3", False), ("req-4", True), ("req-8", False)],
    ]


def test_independent_layers_load_only_the_uncached_tail() -> None:
    from otel_kvtrace.replica.config import Timing
    from otel_kvtrace.replica.plan import build_plan, step_block_ranges

    cfg = ReplicaConfig(num_layers=6, num_shared_buffers=2, independent_layers=(0, 3), requests_per_step=2,
                        timing=Timing(blocks_per_request=8, independent_load_fraction=0.25), steps=1)
    plan = build_plan(cfg)
    assert plan.partial_layers == {0, 3}
    # every GVA load copies the step's one shared list, built from layer 0's tail (upstream _build_shared_load_data)
    assert plan.load_blocks == [4] * 6
    assert build_plan(cfg.with_(independent_layers=(1, 3))).load_blocks == [16] * 6
    full, partial = step_block_ranges(plan, 0)
    assert [(r.start_block, r.end_block) for r in partial] == [(6, 8), (6, 8)]
    assert [(r.start_block, r.end_block) for r in full] == [(0, 8), (0, 8)]
    # without reuse every layer loads the same uncached tail (upstream: `if not layerwise_offload or ...`)
    assert build_plan(cfg.with_(buffer_reuse=False)).load_blocks == [4] * 6


def test_independent_layers_without_load_are_skipped_by_the_window() -> None:
    from otel_kvtrace.replica.config import Timing
    from otel_kvtrace.replica.plan import build_plan

    cfg = ReplicaConfig(num_layers=8, num_shared_buffers=2, prefetch_layers=4, independent_layers=(0, 4),
                        timing=Timing(independent_load_fraction=0.0), steps=1)
    pattern = build_plan(cfg).load_pattern(0)
    assert pattern == (False, True, True, True, False, True, True, True)
    plan = _plan(cfg, has=pattern.__getitem__)
    # layers 0 and 4 have no load task and no source: skipped without counting
    assert plan[0] == [(1, None, 0), (2, None, 0), (3, 1, 0), (5, 2, 0)]
    assert plan[1] == [(6, 3, 1)] and plan[2] == [(7, 5, 2)]


def test_jitter_kinds_keep_the_configured_mean_and_are_seeded() -> None:
    from otel_kvtrace.replica.config import Timing
    from otel_kvtrace.replica.plan import build_plan

    for kind in ("uniform", "lognormal", "exponential"):
        cfg = ReplicaConfig(num_layers=50, steps=100, seed=7,
                            timing=Timing(jitter=kind, jitter_spread=0.3, attention_us=400.0))
        plan = build_plan(cfg)
        mean = sum(plan.attention) / len(plan.attention)
        assert abs(mean / 400_000 - 1) < 0.03, kind  # 5,000 samples, mean-1 factors
        assert min(plan.attention) >= 0 and len(set(plan.attention)) > 100
        assert build_plan(cfg).attention == plan.attention
        assert build_plan(cfg.with_(seed=8)).attention != plan.attention
    steady = build_plan(ReplicaConfig(num_layers=4, steps=2, timing=Timing(attention_us=400.0)))
    assert steady.attention == [400_000] * 8
