"""Hot-path cost per task: otel-kvtrace's Recorder vs. inline OTel SDK spans, measured in one run.

Each task has the shape of one recv task: identity fields, enqueue/dequeue/return/complete stamps,
10 ``(stage, start, end)`` stage records with fresh clock stamps, 2 dependency times, then ``submit``.

- recorder: ``Recorder`` + the real ``BackgroundExporter`` draining to the local JSON-lines file sink
  in the background (the file lands in a temporary directory);
- sdk_inline: the same stamps as OTel SDK spans (root + 10 children started and ended on the recording
  thread with explicit times, ``BatchSpanProcessor`` + in-memory exporter in the background).

Repeats alternate between the two; each repeat records ``--tasks`` tasks on the calling thread and
then waits for the background side to catch up (so no record is dropped and the drop path, which is
cheaper, is never what gets measured). The per-task figure is the recording thread's CPU time
(``time.thread_time_ns``) divided by the tasks; wall-clock figures are printed too.

Run:  .venv/bin/python bench/hot_path.py [--tasks 2000] [--repeats 9]
Last line: hot_path_us_per_task=<median> sdk_inline_us_per_task=<median> ratio=<sdk/hot>
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from otel_kvtrace.export.sinks import JsonLinesFileSink
from otel_kvtrace.export.worker import BackgroundExporter, build_resource
from otel_kvtrace.record.model import Dep, QueueInfo, Stage
from otel_kvtrace.record.recorder import Recorder

# Plain ints, as instrumentation would bind them (an IntEnum attribute lookup costs ~0.1 us).
STAGES = tuple(
    int(s)
    for s in (
        Stage.SAVE_CPU_WAIT,
        Stage.SAVE_NPU_SYNC,
        Stage.GATE_COND_WAIT,
        Stage.GATE_NPU_SYNC,
        Stage.META_BUILD,
        Stage.H2D_STAGGER,
        Stage.SLOT_RELEASE_WAIT,
        Stage.BACKEND_SUBMIT,
        Stage.META_BUILD,  # a second call of a repeated stage
        Stage.CONSUMER_WAIT,
    )
)
STAGE_NAMES = ("save_cpu_wait", "save_npu_sync", "gate_cond_wait", "gate_npu_sync", "meta_build", "h2d_stagger",
               "slot_release_wait", "backend_submit", "meta_build", "consumer_wait")  # fmt: skip
DEP_SAVE_CPU = int(Dep.SAVE_CPU)
DEP_GATE_RECORD = int(Dep.GATE_RECORD)
NUM_LAYERS = 8


# ---- upstream-shaped transfer tasks (referenced by the record, described only at export) -----------
@dataclass
class _Req:
    req_id: str


@dataclass
class _BlockRange:
    request: _Req
    start_block: int
    end_block: int


@dataclass
class _LayerTransferTask:
    group_id: int
    layer_idx_in_group: int
    shared_block_data: Any = None
    block_ranges: list[_BlockRange] = field(default_factory=list)


TRANSFER_TASKS = [
    _LayerTransferTask(0, 0, None, [_BlockRange(_Req("req-a"), 0, 16), _BlockRange(_Req("req-b"), 16, 24)])
]


def make_queue() -> QueueInfo:
    return QueueInfo(run_id="bench", path="gva", thread_name="KVCacheRecvThread", pid=1, tp=0, num_layers=NUM_LAYERS)


def record_tasks(recorder: Recorder, queue: QueueInfo, first_seq: int, n: int) -> None:
    """The recorder hot path for ``n`` tasks (what the instrumented recv/forward threads do)."""
    clock = recorder.clock
    new_record = recorder.new_record
    submit = recorder.submit
    stages = STAGES
    for seq in range(first_seq, first_seq + n):
        rec = new_record()
        rec.queue = queue
        rec.seq = seq
        rec.step = seq >> 3
        layer = seq & 7
        rec.layer_id = layer
        rec.final_layer = layer == 7
        rec.wait_for_save_layer = layer - 2 if layer >= 2 else None
        rec.gate_id = layer
        rec.queue_depth_at_enqueue = 1
        rec.inflight_at_enqueue = 2
        rec.transfer_tasks = TRANSFER_TASKS
        rec.t_enqueue = clock()
        rec.t_dequeue = clock()
        extend = rec.stages.extend
        for stage in stages:
            start = clock()
            extend((stage, start, clock()))
        rec.dep_exact(DEP_SAVE_CPU, clock())
        rec.dep_exact(DEP_GATE_RECORD, clock())
        rec.nbytes = 1 << 20
        rec.t_backend_return = clock()
        rec.t_complete = clock()
        submit(rec)


def sdk_tasks(tracer: Any, set_span_in_context: Any, clock: Any, offset: int, first_seq: int, n: int) -> None:
    """The same tasks as inline OTel SDK spans created and ended on the recording thread."""
    names = STAGE_NAMES
    for seq in range(first_seq, first_seq + n):
        layer = seq & 7
        t_enq = clock() + offset
        root = tracer.start_span(
            "kvtrace.recv.task",
            start_time=t_enq,
            attributes={
                "kvtrace.seq": seq,
                "kvtrace.step": seq >> 3,
                "kvtrace.layer_id": layer,
                "kvtrace.final_layer": layer == 7,
                "kvtrace.gate_id": layer,
                "kvtrace.queue_depth_at_enqueue": 1,
                "kvtrace.inflight_at_enqueue": 2,
            },
        )
        ctx = set_span_in_context(root)
        for name in names:
            start = clock() + offset
            child = tracer.start_span(name, context=ctx, start_time=start)
            child.end(end_time=clock() + offset)
        root.set_attribute("kvtrace.ts.dep.save_cpu", clock() + offset)
        root.set_attribute("kvtrace.ts.dep.gate_record", clock() + offset)
        root.end(end_time=clock() + offset)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=2000, help="tasks per repeat (default 2000)")
    parser.add_argument("--repeats", type=int, default=9, help="alternating repeats (default 9)")
    args = parser.parse_args(argv)
    if args.tasks < 1 or args.repeats < 1:
        parser.error("--tasks and --repeats must be >= 1")

    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import set_span_in_context

    capacity = max(16384, args.tasks)
    recorder = Recorder(capacity=capacity)
    queue = make_queue()
    tmp = tempfile.TemporaryDirectory(prefix="kvtrace-bench-")
    resource = build_resource({"kvtrace.source": "replica", "kvtrace.run_id": "bench"})
    exporter = BackgroundExporter(recorder, JsonLinesFileSink(tmp.name, "bench", resource))

    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "kvtrace-bench"}))
    provider.add_span_processor(BatchSpanProcessor(memory, max_queue_size=12 * args.tasks, max_export_batch_size=512))
    tracer = provider.get_tracer("bench")
    clock = time.perf_counter_ns
    offset = time.time_ns() - clock()

    # Warm up both paths (imports, pools, first-call costs).
    record_tasks(recorder, queue, 0, 200)
    exporter.force_flush(30)
    sdk_tasks(tracer, set_span_in_context, clock, offset, 0, 200)
    provider.force_flush()
    memory.clear()

    hot_cpu: list[float] = []
    hot_wall: list[float] = []
    sdk_cpu: list[float] = []
    sdk_wall: list[float] = []
    seq = 1000
    n = args.tasks
    for rep in range(args.repeats):
        c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
        record_tasks(recorder, queue, seq, n)
        c1, w1 = time.thread_time_ns(), time.perf_counter_ns()
        hot_cpu.append((c1 - c0) / n / 1000)
        hot_wall.append((w1 - w0) / n / 1000)
        exporter.force_flush(60)  # let the background side catch up before the next measurement
        seq += n

        c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
        sdk_tasks(tracer, set_span_in_context, clock, offset, seq, n)
        c1, w1 = time.thread_time_ns(), time.perf_counter_ns()
        sdk_cpu.append((c1 - c0) / n / 1000)
        sdk_wall.append((w1 - w0) / n / 1000)
        provider.force_flush()
        memory.clear()
        seq += n
        print(
            f"repeat {rep + 1}/{args.repeats}: recorder {hot_cpu[-1]:.2f} us/task cpu ({hot_wall[-1]:.2f} wall), "
            f"sdk inline {sdk_cpu[-1]:.1f} us/task cpu ({sdk_wall[-1]:.1f} wall)",
            file=sys.stderr,
        )

    exporter.shutdown(60)
    provider.shutdown()
    exported = exporter.exported_tasks
    tmp.cleanup()
    hot = statistics.median(hot_cpu)
    sdk = statistics.median(sdk_cpu)
    print(f"tasks per repeat: {n}, repeats: {args.repeats}, stages per task: {len(STAGES)}")
    print(f"recorder:   median {hot:.2f} us/task thread-cpu, {statistics.median(hot_wall):.2f} us/task wall")
    print(f"sdk inline: median {sdk:.1f} us/task thread-cpu, {statistics.median(sdk_wall):.1f} us/task wall")
    print(f"recorder drops: {recorder.dropped}, tasks exported to file: {exported}")
    print(f"hot_path_us_per_task={hot:.2f} sdk_inline_us_per_task={sdk:.1f} ratio={sdk / hot:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
