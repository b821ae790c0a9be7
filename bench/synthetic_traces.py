"""Synthetic OTLP/JSON traces that follow docs/schema.md, for tests and benchmarks.

Why: the loader, the HOL SQL and the report need inputs with *known* dependency times before the real
exporter and the replica exist, and the benchmark needs a million tasks. A tiny FIFO simulation turns
per-task arrival and dependency-ready times into the spans the recv thread would have recorded
(dequeue, dependency waits, metadata build, backend submit, completion, consumer wait), so the traces are
self-consistent and carry real head-of-line blocking when a head waits on a dependency while a later task
is already ready.

Use from Python (tests add ``bench/`` to ``sys.path``)::

    from synthetic_traces import QueueSpec, simulate_queue, write_otlp_json
    tasks = simulate_queue(QueueSpec(run_id="r1"), n_tasks=100, seed=1)
    write_otlp_json("traces/kv.jsonl", [(QueueSpec(run_id="r1"), tasks)])

or from the shell: ``python bench/synthetic_traces.py --tasks 1000 --out /tmp/kv.jsonl``.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from otel_kvtrace.export.spans import child_span_ids
from otel_kvtrace.record.model import ALL_CHILD_SPAN_NAMES, QueueInfo, TaskKind, correlation_id, trace_ids_for

BASE_NS = 1_764_000_000_000_000_000  # 2025-11-24, epoch ns
DEP_ORDER = ("save_cpu", "save_npu", "gate_record", "gate_npu", "slot_release")
WAIT_SPAN_OF_DEP = {
    "save_cpu": "save_cpu_wait",
    "save_npu": "save_npu_sync",
    "gate_record": "gate_cond_wait",
    "gate_npu": "gate_npu_sync",
    "slot_release": "slot_release_wait",
}
BOUNDABLE_DEPS = ("save_npu", "gate_npu", "slot_release")


@dataclass(slots=True)
class QueueSpec:
    """One recv FIFO and the resource (process, config) it lives in."""

    run_id: str = "synthetic"
    pid: int = 4242
    thread_name: str = "kv-recv-0"
    path: str = "gva"
    cfg_label: str = "synthetic gva N=8 B=2 P=4"
    num_layers: int = 8
    prefetch_layers: int = 4
    num_shared_buffers: int = 2
    independent_layers: str = "0,4"
    buffer_reuse: bool = True
    tp: int = 0
    source: str = "replica"

    def queue_info(self, thread_name: str | None = None) -> QueueInfo:
        """The same identity the recorder gives a real queue (so ids and formats cannot drift)."""
        return QueueInfo(run_id=self.run_id, path=self.path, thread_name=thread_name or self.thread_name,
                         pid=self.pid, tp=self.tp, num_layers=self.num_layers)

    @property
    def queue_id(self) -> str:
        return self.queue_info().queue_id

    def correlation_id(self, step: int, layer_id: int, save: bool = False) -> str:
        return correlation_id(self.queue_info(), TaskKind.SEND if save else TaskKind.RECV, step, layer_id)


@dataclass(slots=True)
class SynthTask:
    """One recv task with its stamps; ``deps`` maps a dependency to ``(lo, hi)`` (lo == hi: exact)."""

    seq: int
    step: int
    layer_id: int
    final_layer: bool
    enqueue: int
    dequeue: int = 0
    complete: int = 0
    deps: dict[str, tuple[int, int]] = field(default_factory=dict)
    stages: dict[str, tuple[int, int]] = field(default_factory=dict)
    wait_for_save_layer: int | None = None
    gate_id: int | None = None
    queue_depth_at_enqueue: int = 0
    inflight_at_enqueue: int = 0
    num_blocks: int = 4
    nbytes: int = 4 * 131072
    outcome: str = "ok"

    @property
    def bounded(self) -> bool:
        return any(lo != hi for lo, hi in self.deps.values())

    @property
    def ready(self) -> int:
        """``ts.ready``: max of enqueue and every dependency time (upper bounds where bounded)."""
        return max([self.enqueue, *(hi for _, hi in self.deps.values())])

    @property
    def ready_lo(self) -> int:
        return max([self.enqueue, *(lo for lo, _ in self.deps.values())])


def run_fifo(tasks: list[SynthTask], rng: random.Random, service_ns: tuple[int, int] = (20_000, 200_000)) -> None:
    """Serve ``tasks`` (sorted by seq) first-in first-out, filling dequeue/stage/complete times.

    The recv thread dequeues a task when it is free, waits for each dependency in ``DEP_ORDER`` (a wait
    span from its entry until the dependency's upper bound, the time the host learns it), then builds
    metadata, submits and completes. Queue depth and inflight at enqueue are derived from the result.
    """
    free_at = 0
    for task in tasks:
        t = max(free_at, task.enqueue)
        task.dequeue = t
        task.stages = {"queue_wait": (task.enqueue, t)}
        for dep in DEP_ORDER:
            if dep in task.deps:
                hi = task.deps[dep][1]
                end = max(t, hi) + rng.randint(500, 3_000)
                task.stages[WAIT_SPAN_OF_DEP[dep]] = (t, end)
                t = end
        for stage in ("meta_build", "h2d_stagger", "backend_submit", "completion"):
            lo_ns, hi_ns = service_ns if stage == "backend_submit" else (1_000, 10_000)
            end = t + rng.randint(lo_ns, hi_ns)
            task.stages[stage] = (t, end)
            t = end
        task.complete = t
        free_at = t
        wait_start = task.enqueue + rng.randint(0, max(1, t - task.enqueue))
        task.stages["consumer_wait"] = (min(wait_start, t), t + rng.randint(1_000, 5_000))
    dequeues = sorted(task.dequeue for task in tasks)
    completes = sorted(task.complete for task in tasks)
    for task in tasks:
        task.queue_depth_at_enqueue = task.seq - bisect.bisect_right(dequeues, task.enqueue)
        task.inflight_at_enqueue = task.seq - bisect.bisect_right(completes, task.enqueue)
        task.queue_depth_at_enqueue = max(0, task.queue_depth_at_enqueue)
        task.inflight_at_enqueue = max(0, task.inflight_at_enqueue)


def simulate_queue(
    spec: QueueSpec,
    n_tasks: int,
    seed: int = 0,
    *,
    start_ns: int = BASE_NS,
    hol_probability: float = 0.05,
    bounded_probability: float = 0.0,
) -> list[SynthTask]:
    """A realistic layerwise workload: steps of ``num_layers`` tasks, some blocked on slow dependencies.

    With probability ``hol_probability`` a task's save dependency arrives late (1-8 ms), so the tasks
    behind it (whose dependencies are already met) are bypass-ready: head-of-line blocking. With
    ``bounded_probability`` an NPU dependency is only known within ``[lo, hi]``.
    """
    rng = random.Random(seed)
    tasks: list[SynthTask] = []
    n_layers = spec.num_layers
    step_start = start_ns
    t = start_ns
    for seq in range(n_tasks):
        step, layer = divmod(seq, n_layers)
        if layer == 0 and seq:
            # The next step's loads are enqueued once the forward of this one is under way.
            step_start += n_layers * rng.randint(300_000, 600_000)
            t = max(t, step_start)
        t += rng.randint(5_000, 60_000)
        task = SynthTask(seq=seq, step=step, layer_id=layer, final_layer=layer == n_layers - 1, enqueue=t)
        if layer % 2 == 0:
            task.wait_for_save_layer = layer
            slow = rng.random() < hol_probability
            done = t + (rng.randint(1_000_000, 8_000_000) if slow else rng.randint(0, 300_000))
            task.deps["save_cpu"] = (done, done)
            npu = done - rng.randint(1_000, 50_000)
            if rng.random() < bounded_probability:
                task.deps["save_npu"] = (npu - rng.randint(10_000, 2_000_000), done)
            else:
                task.deps["save_npu"] = (npu, npu)
        if layer % 4 == 1:
            task.gate_id = layer - 1
            rec = t + rng.randint(0, 400_000)
            task.deps["gate_record"] = (rec, rec)
            g = rec + rng.randint(1_000, 100_000)
            if rng.random() < bounded_probability:  # lo: the record was issued; hi: first sync return
                task.deps["gate_npu"] = (rec, g + rng.randint(0, 200_000))
            else:
                task.deps["gate_npu"] = (g, g)
        if layer % 3 == 2:
            rel = t + rng.randint(0, 500_000)
            task.deps["slot_release"] = (rel, rel)
        tasks.append(task)
    run_fifo(tasks, rng)
    return tasks


# --- OTLP/JSON encoding ----------------------------------------------------------------------------


def _s(key: str, value: str) -> dict:
    return {"key": key, "value": {"stringValue": value}}


def _i(key: str, value: int) -> dict:
    return {"key": key, "value": {"intValue": str(value)}}


def _b(key: str, value: bool) -> dict:
    return {"key": key, "value": {"boolValue": value}}


def resource_attributes(spec: QueueSpec) -> list[dict]:
    return [
        _s("service.name", "kvtrace"),
        _s("kvtrace.run_id", spec.run_id),
        _s("kvtrace.source", spec.source),
        _s("kvtrace.cfg.label", spec.cfg_label),
        _i("kvtrace.cfg.num_layers", spec.num_layers),
        _i("kvtrace.cfg.prefetch_layers", spec.prefetch_layers),
        _i("kvtrace.cfg.num_shared_buffers", spec.num_shared_buffers),
        _s("kvtrace.cfg.independent_layers", spec.independent_layers),
        _b("kvtrace.cfg.buffer_reuse", spec.buffer_reuse),
        _i("kvtrace.rank.tp", spec.tp),
        _i("kvtrace.rank.tp_size", 1),
        _i("kvtrace.rank.dp", 0),
        _i("kvtrace.rank.pp", 0),
        _i("kvtrace.rank.pcp", 0),
        _i("kvtrace.rank.dcp", 0),
        _s("kvtrace.role", "kv_consumer"),
        _s("vllm_ascend.version", "replica-main"),
        _i("process.pid", spec.pid),
        _s("host.name", "synthetic-host"),
    ]


def _ids(cid: str) -> tuple[str, str]:
    trace_id, span_id = trace_ids_for(cid)
    return trace_id.hex(), span_id.hex()


_CHILD_INDEX = {name: index for index, name in enumerate(ALL_CHILD_SPAN_NAMES)}


def task_spans(spec: QueueSpec, task: SynthTask) -> list[dict]:
    """The root ``kvtrace.recv.task`` span and its children for one task (schema.md)."""
    cid = spec.correlation_id(task.step, task.layer_id)
    trace_id, root_id = _ids(cid)
    attrs = [
        _s("kvtrace.correlation_id", cid),
        _s("kvtrace.path", spec.path),
        _s("kvtrace.queue", spec.queue_id),
        _i("kvtrace.seq", task.seq),
        _i("kvtrace.step", task.step),
        _i("kvtrace.layer_id", task.layer_id),
        _b("kvtrace.final_layer", task.final_layer),
        {"key": "kvtrace.group_ids", "value": {"arrayValue": {"values": [{"intValue": "0"}]}}},
        {
            "key": "kvtrace.request_ids",
            "value": {"arrayValue": {"values": [{"stringValue": f"req-{task.step}"}]}},
        },
        _i("kvtrace.num_blocks", task.num_blocks),
        _i("kvtrace.bytes", task.nbytes),
    ]
    if task.wait_for_save_layer is not None:
        attrs.append(_i("kvtrace.wait_for_save_layer", task.wait_for_save_layer))
    if task.gate_id is not None:
        attrs.append(_i("kvtrace.gate_id", task.gate_id))
    attrs += [
        _i("kvtrace.queue_depth_at_enqueue", task.queue_depth_at_enqueue),
        _i("kvtrace.inflight_at_enqueue", task.inflight_at_enqueue),
        _s("kvtrace.outcome", task.outcome),
        _i("kvtrace.ts.enqueue", task.enqueue),
        _i("kvtrace.ts.dequeue", task.dequeue),
        _i("kvtrace.ts.ready", task.ready),
    ]
    bounded = task.bounded
    if bounded:
        attrs.append(_i("kvtrace.ts.ready_lo", task.ready_lo))
    attrs.append(_i("kvtrace.ts.complete", task.complete))
    for dep, (lo, hi) in task.deps.items():
        if lo == hi:
            attrs.append(_i(f"kvtrace.ts.dep.{dep}", lo))
        else:
            attrs.append(_i(f"kvtrace.ts.dep.{dep}_lo", lo))
            attrs.append(_i(f"kvtrace.ts.dep.{dep}_hi", hi))
    attrs.append(_s("kvtrace.ready_precision", "bounded" if bounded else "exact"))
    end = max(e for _, e in task.stages.values())
    root = {
        "traceId": trace_id,
        "spanId": root_id,
        "name": "kvtrace.recv.task",
        "kind": 1,
        "startTimeUnixNano": str(task.enqueue),
        "endTimeUnixNano": str(end),
        "attributes": attrs,
        "status": {"code": 2, "message": "error"} if task.outcome == "error" else {},
    }
    spans = [root]
    child_ids = child_span_ids(cid)
    task_attrs = [_s("kvtrace.path", spec.path), _s("kvtrace.task", "recv")]
    for name, (start, stop) in task.stages.items():
        child_attrs: list[dict] = []
        if name == "queue_wait":
            child_attrs = [_i("kvtrace.queue_depth_at_enqueue", task.queue_depth_at_enqueue)]
        elif name in ("save_cpu_wait", "save_npu_sync"):
            child_attrs = [_i("kvtrace.src_layer", task.wait_for_save_layer or 0)]
        elif name in ("gate_cond_wait", "gate_npu_sync"):
            child_attrs = [_i("kvtrace.gate_id", task.gate_id or 0)]
        elif name == "meta_build":
            child_attrs = [_i("kvtrace.calls", 1)]
        elif name == "backend_submit":
            child_attrs = [_i("kvtrace.bytes", task.nbytes), _i("kvtrace.result", 0)]
        elif name == "consumer_wait":
            child_attrs = [_s("kvtrace.thread", "forward")]
        spans.append(
            {
                "traceId": trace_id,
                "spanId": child_ids[_CHILD_INDEX[name]],
                "parentSpanId": root_id,
                "name": name,
                "kind": 1,
                "startTimeUnixNano": str(start),
                "endTimeUnixNano": str(stop),
                "attributes": task_attrs + child_attrs,
                "status": {},
            }
        )
    return spans


def send_task_span(spec: QueueSpec, step: int, layer: int, start: int, end: int, seq: int) -> dict:
    """A producer (save) task root; the loader keeps it in ``spans`` and leaves it out of ``tasks``."""
    cid = spec.correlation_id(step, layer, save=True)
    trace_id, root_id = _ids(cid)
    return {
        "traceId": trace_id,
        "spanId": root_id,
        "name": "kvtrace.send.task",
        "kind": 1,
        "startTimeUnixNano": str(start),
        "endTimeUnixNano": str(end),
        "attributes": [
            _s("kvtrace.correlation_id", cid),
            _s("kvtrace.path", spec.path),
            _s("kvtrace.queue", spec.queue_info("kv-send-0").queue_id),
            _i("kvtrace.seq", seq),
            _i("kvtrace.step", step),
            _i("kvtrace.layer_id", layer),
        ],
        "status": {},
    }


def request_lines(spec: QueueSpec, tasks: Sequence[SynthTask], tasks_per_line: int = 50,
                  with_send_tasks: bool = False) -> Iterable[bytes]:
    """OTLP/JSON lines (one ExportTraceServiceRequest each) for one queue's tasks."""
    resource = {"attributes": resource_attributes(spec)}
    scope = {"name": "otel_kvtrace", "attributes": [_i("kvtrace.exporter.dropped", 0)]}
    for offset in range(0, len(tasks), tasks_per_line):
        spans: list[dict] = []
        for task in tasks[offset : offset + tasks_per_line]:
            spans.extend(task_spans(spec, task))
            if with_send_tasks and task.wait_for_save_layer is not None:
                done = task.deps["save_cpu"][1]
                spans.append(send_task_span(spec, task.step, task.layer_id, task.enqueue, done, task.seq))
        doc = {"resourceSpans": [{"resource": resource, "scopeSpans": [{"scope": scope, "spans": spans}]}]}
        yield orjson.dumps(doc) + b"\n"


def write_otlp_json(path: str | Path, queues: Sequence[tuple[QueueSpec, Sequence[SynthTask]]],
                    tasks_per_line: int = 50, with_send_tasks: bool = False) -> Path:
    """Write every queue's tasks to ``path`` (gzip when it ends in ``.gz``); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wb") as out:
        for spec, tasks in queues:
            for line in request_lines(spec, tasks, tasks_per_line, with_send_tasks):
                out.write(line)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=1000, help="tasks per queue")
    parser.add_argument("--queues", type=int, default=1)
    parser.add_argument("--out", required=True, help="output .jsonl or .jsonl.gz")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    queues = []
    for q in range(args.queues):
        spec = QueueSpec(run_id=f"synthetic{q}", pid=4000 + q)
        queues.append((spec, simulate_queue(spec, args.tasks, seed=args.seed + q)))
    print(write_otlp_json(args.out, queues))


if __name__ == "__main__":
    main()
