"""Hand-made, realistic task records for the exporter tests (no recorder thread involved).

A uniquely named module (not ``conftest``) so ``from export_records import ...`` cannot pick up another
directory's helpers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from otel_kvtrace.record.model import Dep, Outcome, QueueInfo, Stage, TaskKind, TaskRecord
from otel_kvtrace.record.recorder import ClockAnchor

# Clock stamps are "perf_counter ns" around 5 s; the anchor maps clock 0 to epoch 1.7e18.
ANCHOR = ClockAnchor(clock_ns=0, epoch_ns=1_700_000_000_000_000_000)
T0 = 5_000_000_000


@dataclass
class FakeReq:
    req_id: str


@dataclass
class FakeBlockRange:
    request: FakeReq
    start_block: int
    end_block: int


@dataclass
class FakeShared:
    req_ids: list[str]
    block_ids_arr: list[int]
    is_last_chunks: list[bool]
    load_keys: list[str]


@dataclass
class FakeLayerTransferTask:
    """Shaped like upstream ``LayerTransferTask`` (the fields the exporter reads)."""

    group_id: int
    layer_idx_in_group: int
    shared_block_data: FakeShared | None = None
    block_ranges: list[FakeBlockRange] = field(default_factory=list)


QUEUE = QueueInfo(run_id="run42", path="gva", thread_name="KVCacheRecvThread", pid=1234, tp=1, num_layers=8)


def fill_record(
    rec: TaskRecord,
    *,
    queue: QueueInfo = QUEUE,
    seq: int = 3,
    step: int = 2,
    layer_id: int = 5,
    t0: int = T0,
    src_layer: int | None = 3,
    gate_id: int | None = 4,
    bounded_npu: bool = True,
    save_cpu_calls: int = 2,
    outcome: int = Outcome.OK,
    error: BaseException | None = None,
    kind: int = TaskKind.RECV,
    consumer_wait: bool = True,
) -> TaskRecord:
    """A recv task as the instrumented recv thread would record it (stamps in ns from ``t0``)."""
    rec.queue = queue
    rec.kind = kind
    rec.seq, rec.step, rec.layer_id = seq, step, layer_id
    rec.final_layer = layer_id == queue.num_layers - 1
    rec.wait_for_save_layer = src_layer
    rec.gate_id = gate_id
    rec.queue_depth_at_enqueue = 2
    rec.inflight_at_enqueue = 3
    rec.t_enqueue = t0
    rec.t_dequeue = t0 + 1_000
    t = t0 + 1_000
    if src_layer is not None:
        for _ in range(save_cpu_calls):  # timeout loop: several wait calls
            rec.stages.extend((Stage.SAVE_CPU_WAIT, t, t + 400))
            t += 500
        rec.stages.extend((Stage.SAVE_NPU_SYNC, t, t + 300))
        rec.dep_exact(Dep.SAVE_CPU, t - 150)
        if bounded_npu:
            rec.dep_bounds(Dep.SAVE_NPU, t - 200, t + 300)
        else:
            rec.dep_exact(Dep.SAVE_NPU, t + 250)
        t += 400
    if gate_id is not None:
        rec.stages.extend((Stage.GATE_COND_WAIT, t, t + 700))
        rec.dep_exact(Dep.GATE_RECORD, t + 650)
        rec.stages.extend((Stage.GATE_NPU_SYNC, t + 700, t + 900))
        rec.dep_bounds(Dep.GATE_NPU, t + 660, t + 900) if bounded_npu else rec.dep_exact(Dep.GATE_NPU, t + 880)
        t += 1_000
    rec.stages.extend((Stage.META_BUILD, t, t + 100))
    rec.stages.extend((Stage.META_BUILD, t + 150, t + 250))
    t += 300
    rec.stages.extend((Stage.H2D_STAGGER, t, t + 50))
    rec.stages.extend((Stage.SLOT_RELEASE_WAIT, t + 60, t + 80))
    rec.dep_exact(Dep.SLOT_RELEASE, t + 75)
    t += 100
    rec.stages.extend((Stage.BACKEND_SUBMIT, t, t + 2_000))
    rec.nbytes = 1 << 20
    rec.backend_result = 0
    rec.t_backend_return = t + 2_000
    rec.t_complete = t + 2_100
    if consumer_wait:
        rec.stages.extend((Stage.CONSUMER_WAIT, t0 + 500, t + 2_150))
    rec.outcome = outcome
    rec.error = error
    shared = FakeShared(["reqA", "reqB", "reqA"], [10, 11, 12, 13], [False, True, False], ["k1"])
    rec.transfer_tasks = [
        FakeLayerTransferTask(group_id=1, layer_idx_in_group=layer_id, shared_block_data=shared),
        FakeLayerTransferTask(
            group_id=0,
            layer_idx_in_group=layer_id,
            block_ranges=[FakeBlockRange(FakeReq("reqC"), 0, 3), FakeBlockRange(FakeReq("reqA"), 5, 7)],
        ),
    ]
    return rec
