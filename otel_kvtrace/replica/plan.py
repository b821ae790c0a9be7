"""Per-step work plan: requests, block counts and every sampled duration, drawn once from the seed.

Both engines read durations from the same plan, so a threaded run and a virtual run of one config see
the same work; only the clock differs.
"""

from __future__ import annotations

from dataclasses import dataclass

from otel_kvtrace.replica.config import Jitter, ReplicaConfig


@dataclass(slots=True, frozen=True)
class PlannedRequest:
    req_id: str
    is_last_chunk: bool
    num_blocks: int
    start_block: int


@dataclass(slots=True)
class WorkPlan:
    """Flat per-(step, layer) duration tables in ns, indexed ``step * num_layers + layer``."""

    num_layers: int
    steps: int
    requests: list[list[PlannedRequest]]
    blocks: list[int]
    """Blocks loaded (and saved) per layer in each step."""
    host_launch: list[int]
    attention: list[int]
    compute: list[int]
    save_copy: list[int]
    load_copy: list[int]
    meta_build: list[int]
    stagger: list[int]
    slot_release: list[int]
    late_gate: list[int]
    fail_index: int
    """``step * num_layers + layer`` whose load copy fails, or -1."""
    has_slot_release_waiter: bool

    def has_transfer(self, step: int) -> bool:
        return bool(self.requests[step])


def build_plan(cfg: ReplicaConfig) -> WorkPlan:
    """Sample the whole run. Deterministic for a given config (including ``seed``)."""
    cfg.validate()
    t = cfg.timing
    s = cfg.slow
    n = cfg.num_layers
    jit = Jitter(t, cfg.seed, 0)
    requests: list[list[PlannedRequest]] = []
    blocks: list[int] = []
    per_chunk = t.blocks_per_request
    for step in range(cfg.steps):
        batch = []
        for slot in range(cfg.requests_per_step):
            # Requests are staggered by slot, so concurrent requests are at different chunks in a step.
            chunk = (step + slot) % cfg.chunks_per_request
            generation = (step + slot) // cfg.chunks_per_request
            req_id = f"req-{generation * cfg.requests_per_step + slot}"
            nblocks = per_chunk if t.jitter == "none" else max(1, jit.ns(per_chunk) // 1000)
            batch.append(PlannedRequest(req_id, chunk == cfg.chunks_per_request - 1, nblocks, chunk * per_chunk))
        requests.append(batch)
        blocks.append(sum(r.num_blocks for r in batch))
    total = cfg.steps * n
    slow_save = set(s.slow_save_layers)
    slow_release = set(s.slow_slot_release_layers)
    late_gate = set(s.late_gate_layers)
    tables: dict[str, list[int]] = {k: [0] * total for k in (
        "host_launch", "attention", "compute", "save_copy", "load_copy", "meta_build", "stagger",
        "slot_release", "late_gate")}
    jitters = {k: Jitter(t, cfg.seed, i + 1) for i, k in enumerate(tables)}
    for step in range(cfg.steps):
        nb = blocks[step]
        means = {
            "host_launch": t.host_launch_us,
            "attention": t.attention_us,
            "compute": t.layer_compute_us,
            "save_copy": t.copy_call_us + nb * t.save_d2h_us_per_block,
            "load_copy": t.copy_call_us + nb * t.load_h2d_us_per_block,
            "meta_build": t.meta_build_us,
            "slot_release": t.slot_release_us,
        }
        base = step * n
        for key, mean in means.items():
            table = tables[key]
            table[base:base + n] = jitters[key].many_ns(mean, n)
        for layer in range(n):
            i = base + layer
            tables["stagger"][i] = int(((cfg.tp_rank + layer) % cfg.tp_size) * t.h2d_stagger_us * 1000)
            if layer in slow_save:
                tables["save_copy"][i] += int(s.slow_save_us * 1000)
            if layer in slow_release:
                tables["slot_release"][i] += int(s.slow_slot_release_us * 1000)
            if layer in late_gate:
                tables["late_gate"][i] = int(s.late_gate_us * 1000)
    fail = -1
    if s.fail_copy_at is not None:
        fail = s.fail_copy_at[0] * n + s.fail_copy_at[1]
    waiter = cfg.behaviour == "main" and cfg.path == "gva" and (
        t.slot_release_us > 0 or bool(s.slow_slot_release_layers))
    return WorkPlan(n, cfg.steps, requests, blocks, fail_index=fail, has_slot_release_waiter=waiter, **tables)
