"""Per-step work plan: requests, block counts and every sampled duration, drawn once from the seed.

Both engines read durations from the same plan, so a threaded run and a virtual run of one config see
the same work; only the clock differs. Sampling is vectorised with numpy (one generator seeded with
``seed``, tables drawn in a fixed order), so plans stay cheap next to the simulation itself.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from otel_kvtrace.replica.config import ReplicaConfig, Timing
from otel_kvtrace.replica.layout import build_layout
from otel_kvtrace.replica.metadata import LayerBlockRange, ReqMeta

DURATION_TABLES = (
    "host_launch", "attention", "compute", "save_copy", "load_copy", "meta_build", "slot_release",
)


@dataclass(slots=True, frozen=True)
class PlannedRequest:
    req_id: str
    is_last_chunk: bool
    num_blocks: int
    start_block: int
    independent_blocks: int
    """Blocks vLLM has not cached (the tail of the request's chunk): what an independent layer loads with
    buffer reuse, and what every layer loads without it."""

    @property
    def end_block(self) -> int:
        return self.start_block + self.num_blocks


@dataclass(slots=True)
class WorkPlan:
    """Flat per-(step, layer) duration tables in ns, indexed ``step * num_layers + layer``."""

    num_layers: int
    steps: int
    requests: list[list[PlannedRequest]]
    blocks: list[int]
    """Blocks saved per layer in each step (and loaded by reused layers)."""
    load_blocks: list[int]
    """Blocks copied per (step, layer), 0 = no load task. A layer's own ranges hold ``independent_blocks`` on
    ``partial_layers``; on the GVA path every load task copies the step's shared list, built from the first
    layer that has a load task."""
    partial_layers: frozenset[int]
    """Layers that load only ``independent_blocks`` of each request: the independent layers when buffers are
    really shared (``has_layer_reuse``), every layer otherwise."""
    host_launch: list[int]
    attention: list[int]
    compute: list[int]
    save_copy: list[int]
    load_copy: list[int]
    meta_build: list[int]
    slot_release: list[int]
    stagger: list[int]
    late_gate: list[int]
    fail_index: int
    """``step * num_layers + layer`` whose load copy fails, or -1."""
    has_slot_release_waiter: bool
    lease_release_ns: int
    """Duration of the final layer's ``batch_remove_lease`` (half a copy call)."""

    def has_transfer(self, step: int) -> bool:
        return bool(self.requests[step])

    def load_pattern(self, step: int) -> tuple[bool, ...]:
        """Per layer: whether the step has a load task for it."""
        base = step * self.num_layers
        return tuple(b > 0 for b in self.load_blocks[base:base + self.num_layers])


def _factors(timing: Timing, rng: np.random.Generator, size: int) -> np.ndarray | None:
    """Multiplicative jitter with mean 1 (``None`` = no jitter)."""
    spread = timing.jitter_spread
    if timing.jitter == "none" or spread == 0:
        return None
    if timing.jitter == "uniform":
        return 1.0 + rng.uniform(-spread, spread, size)
    if timing.jitter == "lognormal":
        return rng.lognormal(-0.5 * spread * spread, spread, size)
    return (1.0 - spread) + rng.exponential(spread, size)  # exponential tail on a fixed floor


def _sample_ns(mean_us: np.ndarray, timing: Timing, rng: np.random.Generator) -> np.ndarray:
    factors = _factors(timing, rng, mean_us.size)
    ns = mean_us * 1000.0 if factors is None else mean_us * 1000.0 * factors
    return np.maximum(ns, 0.0).astype(np.int64)


def build_plan(cfg: ReplicaConfig, *, validate: bool = True) -> WorkPlan:
    """Sample the whole run. Deterministic for a given config (including ``seed``)."""
    if validate:
        cfg.validate()
    t = cfg.timing
    s = cfg.slow
    n, steps = cfg.num_layers, cfg.steps
    rng = np.random.default_rng(cfg.seed)

    per_chunk = t.blocks_per_request
    block_counts = _sample_ns(np.full(steps * cfg.requests_per_step, float(per_chunk)), t, rng) // 1000
    requests: list[list[PlannedRequest]] = []
    blocks: list[int] = []
    k = 0
    for step in range(steps):
        batch = []
        for slot in range(cfg.requests_per_step):
            # Requests are staggered by slot, so concurrent requests are at different chunks in a step.
            chunk = (step + slot) % cfg.chunks_per_request
            generation = (step + slot) // cfg.chunks_per_request
            req_id = f"req-{generation * cfg.requests_per_step + slot}"
            nblocks = max(1, int(block_counts[k]))
            k += 1
            partial = round(nblocks * t.independent_load_fraction)
            last = chunk == cfg.chunks_per_request - 1
            batch.append(PlannedRequest(req_id, last, nblocks, chunk * per_chunk, partial))
        requests.append(batch)
        blocks.append(sum(r.num_blocks for r in batch))

    total = steps * n
    # Upstream (main pool_worker ``_process_load_for_layer_batch``) starts a load at vLLM's cached tokens
    # `if not self.layerwise_offload or layer_id in self.independent_layers`, else at block 0; layerwise_offload
    # is the layout's has_layer_reuse. So only really shared buffers make reused layers reload the whole chunk;
    # without reuse (B=N, v0.23, key path) every layer loads the same uncached tail.
    if build_layout(cfg).has_layer_reuse:
        partial_layers = frozenset(cfg.resolved_independent)
    else:
        partial_layers = frozenset(range(n))
    partial_blocks = [sum(r.independent_blocks for r in batch) for batch in requests]
    load_blocks: list[int] = []
    for step in range(steps):
        own = [partial_blocks[step] if layer in partial_layers else blocks[step] for layer in range(n)]
        if cfg.path == "gva":
            # Upstream's _build_shared_load_data builds ONE SharedBlockData per group and step from the first
            # layer that has a load task and attaches it to every load task; the recv thread copies only
            # that list. So every layer with a load task copies the first one's blocks.
            first = next((b for b in own if b > 0), 0)
            own = [first if b > 0 else 0 for b in own]
        load_blocks.extend(own)
    step_blocks = np.repeat(np.asarray(blocks, dtype=np.float64), n)
    layer_load_blocks = np.asarray(load_blocks, dtype=np.float64)
    means = {
        "host_launch": np.full(total, t.host_launch_us),
        "attention": np.full(total, t.attention_us),
        "compute": np.full(total, t.layer_compute_us),
        "save_copy": t.copy_call_us + step_blocks * t.save_d2h_us_per_block,
        "load_copy": t.copy_call_us + layer_load_blocks * t.load_h2d_us_per_block,
        "meta_build": np.full(total, t.meta_build_us),
        "slot_release": np.full(total, t.slot_release_us),
    }
    tables = {name: _sample_ns(means[name], t, rng) for name in DURATION_TABLES}
    layer_of = np.tile(np.arange(n), steps)
    if s.slow_save_layers:
        tables["save_copy"] += np.isin(layer_of, s.slow_save_layers) * int(s.slow_save_us * 1000)
    if s.slow_slot_release_layers:
        tables["slot_release"] += np.isin(layer_of, s.slow_slot_release_layers) * int(s.slow_slot_release_us * 1000)
    late_gate = np.isin(layer_of, s.late_gate_layers) * int(s.late_gate_us * 1000)
    stagger = ((cfg.tp_rank + layer_of) % cfg.tp_size * (t.h2d_stagger_us * 1000)).astype(np.int64)
    fail = -1
    if s.fail_copy_at is not None:
        fail = s.fail_copy_at[0] * n + s.fail_copy_at[1]
    waiter = cfg.behaviour == "main" and cfg.path == "gva" and (
        t.slot_release_us > 0 or bool(s.slow_slot_release_layers))
    return WorkPlan(
        n, steps, requests, blocks, load_blocks, partial_layers,
        **{name: table.tolist() for name, table in tables.items()},
        stagger=stagger.tolist(), late_gate=late_gate.tolist(),
        fail_index=fail, has_slot_release_waiter=waiter, lease_release_ns=int(t.copy_call_us * 500),
    )


def step_block_ranges(plan: WorkPlan, step: int) -> tuple[list[LayerBlockRange], list[LayerBlockRange]]:
    """Block ranges of one step: ``(full, partial)``. Saves and reused layers' loads use ``full``;
    independent layers (``plan.partial_layers``) load ``partial``, the tail of each request's chunk."""
    full: list[LayerBlockRange] = []
    partial: list[LayerBlockRange] = []
    for r in plan.requests[step]:
        meta = ReqMeta(r.req_id, r.is_last_chunk, r.num_blocks)
        full.append(LayerBlockRange(meta, r.start_block, r.end_block))
        if r.independent_blocks > 0:
            partial.append(LayerBlockRange(meta, r.end_block - r.independent_blocks, r.end_block))
    return full, partial


PER_STEP_LAYER = (*DURATION_TABLES, "load_blocks", "stagger", "late_gate")
"""The ``step * num_layers + layer`` tables of a :class:`WorkPlan`."""


def repeat_rows(plan: WorkPlan, rows: list[int]) -> WorkPlan:
    """A plan whose step ``i`` is ``plan``'s step ``rows[i]`` (same requests, blocks and durations): the
    fidelity bench's interleaved design runs each step's work twice in a row, once per policy. No copy
    fails (``fail_index`` -1)."""
    n = plan.num_layers

    def per_layer(table: list[int]) -> list[int]:
        return [v for r in rows for v in table[r * n:(r + 1) * n]]

    return replace(plan, steps=len(rows), requests=[plan.requests[r] for r in rows],
                   blocks=[plan.blocks[r] for r in rows], fail_index=-1,
                   **{name: per_layer(getattr(plan, name)) for name in PER_STEP_LAYER})
