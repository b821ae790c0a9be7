"""Virtual-clock engine: the layerwise load/save pipeline as a small discrete-event simulation.

Two actors (forward and recv, ``sim_engine.py``; the send thread is computed inline) are generators that
run until they wait on a signal whose time is not known yet (a load event, a save event, a gate record,
a queue item). When a signal fires, the waiting actor's resume is pushed on one heap ordered by the
single key ``(time, seq)`` (``events.py``). A wait on a signal that already fired costs no event: the actor just takes
``max(now, fired_time)``. Device times follow the fake NPU's stream arithmetic, so they are exact.

Output: one ``TaskRecord`` per recv task and per save task, filled as the instrumentation fills them on
real threads, plus per-step forward figures (``SimResult``, ``sim_result.py``).
"""

from __future__ import annotations

import gc
import time
from pathlib import Path

from otel_kvtrace import config
from otel_kvtrace.record.model import TaskRecord
from otel_kvtrace.record.recorder import ClockAnchor, Recorder
from otel_kvtrace.replica.config import ReplicaConfig
from otel_kvtrace.replica.fake_npu import VirtualClock
from otel_kvtrace.replica.plan import build_plan
from otel_kvtrace.replica.sim_engine import BLOCK_BYTES, RECV_THREAD_NAMES, SEND_THREAD_NAMES, Simulation
from otel_kvtrace.replica.sim_result import SimResult, StepOutcome, ready_time

__all__ = [
    "BLOCK_BYTES",
    "DEFAULT_EPOCH_NS",
    "RECV_THREAD_NAMES",
    "SEND_THREAD_NAMES",
    "SimResult",
    "StepOutcome",
    "ready_time",
    "simulate",
    "simulate_to_recorder",
    "simulate_to_traces",
]

DEFAULT_EPOCH_NS = 1_767_225_600_000_000_000  # 2026-01-01T00:00:00Z: virtual time 0 maps here


def simulate(cfg: ReplicaConfig, *, run_id: str | None = None, pid: int = 0) -> SimResult:
    """Run ``cfg`` on the virtual clock; deterministic for a given config (including its seed)."""
    cfg.validate()
    plan = build_plan(cfg, validate=False)
    # The run allocates many small long-lived records; cyclic GC passes over them cost more than the
    # simulation itself, and nothing here creates reference cycles that need collecting mid-run.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return Simulation(cfg, plan, run_id or f"replica-sim-s{cfg.seed}", pid).run()
    finally:
        if was_enabled:
            gc.enable()


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
    out_dir: str | Path = config.DEFAULT_DATA_DIR,
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
