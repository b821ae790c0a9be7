"""Worst recording call while the OTLP endpoint is down: agent vs in-process exporter, one run.

A black-hole endpoint (a TCP listener that accepts and never answers) is the OTLP/HTTP target. The
calling thread records ``--tasks`` realistic recv tasks (``tests/export/export_records.py``) at
``--rate`` per second, timing each ``new_record`` + fill + ``submit`` call with ``perf_counter_ns``;
the GC stays on (a pause it causes on the recording thread is part of what is measured). Modes
alternate per repeat: ``agent`` (ring + exporter process) and ``thread`` (in-process exporter).

Usage: python bench/recording_stall.py [--tasks 30000] [--rate 5000] [--repeats 3]
Last line: ``worst_record_call_ms_agent=<median> worst_record_call_ms_thread=<median>``
"""

from __future__ import annotations

import argparse
import gc
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "export"))

from export_records import fill_record  # noqa: E402

from otel_kvtrace.export.agent_link import AgentExporter  # noqa: E402
from otel_kvtrace.export.worker import build_resource, create_exporter  # noqa: E402
from otel_kvtrace.record.recorder import Recorder  # noqa: E402


def record_at_rate(recorder: Recorder, tasks: int, rate: int, cpu: list[int]) -> list[int]:
    """Per-call wall ns of ``tasks`` recordings paced at ``rate``/s (per-call CPU ns into ``cpu``: a call
    with a long wall time but little CPU was descheduled by the OS, not working or blocked by us)."""
    durations = []
    period = 1e9 / rate
    start = time.perf_counter_ns()
    for i in range(tasks):
        c0 = time.thread_time_ns()
        t0 = time.perf_counter_ns()
        rec = recorder.new_record()
        fill_record(rec, seq=i)
        recorder.submit(rec)
        durations.append(time.perf_counter_ns() - t0)
        cpu.append(time.thread_time_ns() - c0)
        target = start + (i + 1) * period
        while time.perf_counter_ns() < target:
            time.sleep(max(0.0, (target - time.perf_counter_ns()) / 1e9 - 0.0002))
    return durations


class GcPauses:
    """Longest cyclic-GC pause seen in this process (``gc.callbacks``), to tell GC from scheduling."""

    def __init__(self) -> None:
        self.longest_ns = 0
        self._t0 = 0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter_ns()
        else:
            self.longest_ns = max(self.longest_ns, time.perf_counter_ns() - self._t0)


def run(mode: str, endpoint: str, tasks: int, rate: int) -> tuple[float, float, int, float, float]:
    recorder = Recorder()
    resource = build_resource({"service.name": "bench-stall"})
    if mode == "agent":
        exporter = AgentExporter(recorder, resource, endpoint=endpoint, protocol="http/protobuf")
    else:
        exporter = create_exporter(recorder, resource, endpoint=endpoint, protocol="http/protobuf")
    pauses = GcPauses()
    gc.callbacks.append(pauses)
    try:
        cpu: list[int] = []
        durations = record_at_rate(recorder, tasks, rate, cpu)
    finally:
        gc.callbacks.remove(pauses)
    exporter.shutdown(1.0)
    durations.sort()
    return (durations[-1] / 1e6, durations[int(0.999 * (len(durations) - 1))] / 1e6, recorder.dropped,
            pauses.longest_ns / 1e6, max(cpu) / 1e6)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=30000)
    parser.add_argument("--rate", type=int, default=5000, help="tasks per second (default 5000)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if min(args.tasks, args.rate, args.repeats) < 1:
        parser.error("--tasks, --rate and --repeats must be >= 1")
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(64)  # accepts (kernel backlog), never reads or answers
    endpoint = f"http://127.0.0.1:{hole.getsockname()[1]}"
    worst: dict[str, list[float]] = {"agent": [], "thread": []}
    for i in range(args.repeats):
        for mode in worst:
            w, p999, dropped, gc_ms, cpu_ms = run(mode, endpoint, args.tasks, args.rate)
            worst[mode].append(w)
            print(f"repeat {i + 1} {mode:6}: worst call {w:.2f} ms (most CPU in one call {cpu_ms:.2f} ms), "
                  f"p99.9 {p999:.3f} ms, longest GC pause {gc_ms:.2f} ms, dropped {dropped}", flush=True)
    hole.close()
    print(f"worst_record_call_ms_agent={statistics.median(worst['agent']):.2f} "
          f"worst_record_call_ms_thread={statistics.median(worst['thread']):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
