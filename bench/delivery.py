"""Delivery under a misbehaving OTLP endpoint: what is lost, what is counted, what the recording thread pays.

A recording thread records tasks through the real ``Recorder`` at a fixed rate (``hot_path.record_tasks``,
the instrumented threads' work) while the real ``BackgroundExporter`` ships them to a loopback receiver
that misbehaves. Variants, alternated in one run: ``direct`` (``OTEL_KVTRACE_SPOOL_MAX_MB=0``: the SDK
exporters send inline, as before the delivery spool) and ``spool`` (the default ``DeliveringSink``).
Per run it prints recorded / delivered / spooled / dropped / unaccounted (recorded minus the other
three), the tasks the receiver acknowledged (distinct root spans), for ``spool`` the tasks that arrive
once ``kvtrace resend`` sends what was left to a working receiver, and the worst recording call
(``new_record`` .. ``submit`` of one task), its p99.9, and the longest cyclic-GC pass that ran on the
recording thread while it recorded.

Scenarios: ``slow`` (gRPC receiver sleeping 0.3 s per request, 2,400 tasks), ``exhausted`` (gRPC
RESOURCE_EXHAUSTED for the first 5 requests), ``blackhole`` (HTTP endpoint that accepts TCP and never
answers, 30,000 tasks at 5,000/s), ``killed`` (gRPC receiver stopped at half-time, revived 2 s later).

Usage: python bench/delivery.py [--scenarios slow,exhausted,blackhole,killed] [--repeats 1] [--sdk-timeout 2]
Last line: ``worst_record_call_ms_blackhole direct=<median> spool=<median>``
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "export"))

from fault_receivers import BlackHole, GrpcReceiver, HttpReceiver  # noqa: E402
from hot_path import make_queue, record_tasks  # noqa: E402

from otel_kvtrace.export import create_exporter  # noqa: E402
from otel_kvtrace.record.recorder import Recorder  # noqa: E402

SHUTDOWN_S = 5.0


def scenario(name: str) -> tuple[Any, str, int, int]:
    """(receiver, protocol, tasks, rate per s)."""
    if name == "slow":
        return GrpcReceiver(sleep_s=0.3), "grpc", 2400, 5000
    if name == "exhausted":
        import grpc

        return GrpcReceiver(refuse=5, code=grpc.StatusCode.RESOURCE_EXHAUSTED), "grpc", 2400, 5000
    if name == "blackhole":
        return BlackHole(), "http/protobuf", 30_000, 5000
    if name == "killed":
        return GrpcReceiver(), "grpc", 2400, 1000
    raise SystemExit(f"unknown scenario {name!r}")


def run(name: str, variant: str, spool_root: str, sdk_timeout_s: float = 2.0) -> dict[str, Any]:
    os.environ["OTEL_KVTRACE_SPOOL_MAX_MB"] = "0" if variant == "direct" else "512"
    os.environ["OTEL_KVTRACE_SPOOL_DIR"] = spool_root
    os.environ["OTEL_EXPORTER_OTLP_TRACES_TIMEOUT"] = str(sdk_timeout_s)
    receiver, protocol, tasks, rate = scenario(name)
    recorder = Recorder()
    exporter = create_exporter(recorder, {"kvtrace.run_id": f"bench-{name}-{variant}"},
                               endpoint=receiver.endpoint, protocol=protocol)
    queue = make_queue()
    gc_pauses: list[int] = []
    gc_start = [0]
    me = threading.get_ident()

    def on_gc(phase: str, info: dict[str, int]) -> None:  # GC passes that run on the recording thread
        if threading.get_ident() == me:
            if phase == "start":
                gc_start[0] = time.perf_counter_ns()
            else:
                gc_pauses.append(time.perf_counter_ns() - gc_start[0])

    gc.callbacks.append(on_gc)
    worst = 0
    samples = []
    period = 1.0 / rate
    start = time.perf_counter()
    revive = None
    for seq in range(tasks):
        due = start + seq * period
        now = time.perf_counter()
        if due > now:
            time.sleep(due - now)
        t0 = time.perf_counter_ns()
        record_tasks(recorder, queue, seq, 1)
        dt = time.perf_counter_ns() - t0
        samples.append(dt)
        worst = max(worst, dt)
        if name == "killed" and seq == tasks // 2:
            receiver.stop()
            revive = threading.Timer(2.0, receiver.start)
            revive.start()
    gc.callbacks.remove(on_gc)
    exporter.shutdown(timeout_s=SHUTDOWN_S)
    if revive is not None:
        revive.join()
    acked = len(getattr(receiver, "acked", None).roots) if hasattr(receiver, "acked") else 0
    receiver.stop()
    stats = exporter.stats() if hasattr(exporter, "stats") else None
    delivered = stats.delivered if stats else exporter.exported_tasks
    spooled = stats.spooled if stats else 0
    dropped = stats.dropped if stats else recorder.dropped
    after = acked
    spool = getattr(exporter.sink, "spool", None)
    if spooled and spool is not None:
        from otel_kvtrace.export.resend import resend

        good = GrpcReceiver() if protocol == "grpc" else HttpReceiver()
        resend(spool.directory, endpoint=good.endpoint, timeout_s=120)
        good.stop()
        after = acked + len(good.acked.roots)
    samples.sort()
    return {
        "recorded": tasks, "delivered": delivered, "spooled": spooled, "dropped": dropped,
        "unaccounted": tasks - delivered - spooled - dropped, "receiver": acked, "after_recovery": after,
        "worst_ms": worst / 1e6, "p999_ms": samples[int(0.999 * (len(samples) - 1))] / 1e6,
        "gc_max_ms": max(gc_pauses, default=0) / 1e6,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", default="slow,exhausted,blackhole,killed")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--sdk-timeout", type=float, default=2.0,
                        help="OTEL_EXPORTER_OTLP_TRACES_TIMEOUT per request, s (the SDK default is 10)")
    args = parser.parse_args(argv)
    print(f"load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; gc thresholds {gc.get_threshold()}")
    worst: dict[str, list[float]] = {"direct": [], "spool": []}
    header = (f"{'scenario':<10} {'variant':<7} {'recorded':>8} {'delivered':>9} {'spooled':>7} {'dropped':>7} "
              f"{'unaccounted':>11} {'receiver':>8} {'after_rec':>9} {'worst_ms':>8} {'p999_ms':>7} {'gc_max_ms':>9}")
    print(header)
    with tempfile.TemporaryDirectory() as spool_root:
        for _ in range(args.repeats):
            for name in args.scenarios.split(","):
                for variant in ("direct", "spool"):
                    r = run(name, variant, spool_root, args.sdk_timeout)
                    print(f"{name:<10} {variant:<7} {r['recorded']:>8} {r['delivered']:>9} {r['spooled']:>7} "
                          f"{r['dropped']:>7} {r['unaccounted']:>11} {r['receiver']:>8} {r['after_recovery']:>9} "
                          f"{r['worst_ms']:>8.2f} {r['p999_ms']:>7.3f} {r['gc_max_ms']:>9.2f}", flush=True)
                    if name == "blackhole":
                        worst[variant].append(r["worst_ms"])
    if worst["direct"]:
        print(f"worst_record_call_ms_blackhole direct={statistics.median(worst['direct']):.2f} "
              f"spool={statistics.median(worst['spool']):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
