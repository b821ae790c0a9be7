"""Host CPU cost of the engine-loop instrumentation: untraced vs traced replica engine loop, same run.

The asynccheck replica (``otel_kvtrace/asynccheck/replica.py``) runs vLLM V1's engine loop shapes
(``ReplicaEngineCore.step_with_batch_queue`` / ``step``, ``ReplicaScheduler.schedule`` /
``update_from_output``, ``ReplicaExecutor.execute_model``, ``ReplicaModelRunnerOutput.get_output``) on a
virtual clock, so device time costs no host time and what is measured is the Python engine loop alone.
Each repeat runs ``--steps`` steps twice, once with ``EngineLoopInstrumentation(buffer,
owners=REPLICA_OWNERS)`` installed and once without (``install()`` / ``uninstall()``, the calls
``run_replica`` makes; the arms alternate which goes first), timing ``engine.run()`` with
``time.thread_time_ns`` (CPU time of this thread, so other processes on a shared machine count less).
Then a tight loop calls ``scheduler.schedule()`` ``--calls`` times on a wrapped and an unwrapped
scheduler: the cost of one wrapped method. In the async loop each step passes through five wrapped
methods (``step_with_batch_queue``, ``schedule``, ``execute_model``, ``get_output``,
``update_from_output``).

Stamps take their time from ``time.perf_counter_ns`` by default, as in a vLLM process; ``--stamp-clock
virtual`` uses the replica's virtual clock (a Python-level call), as ``run_replica`` does. Stamp buffers
are sized so nothing is dropped; the script checks every traced arm recorded one ``schedule`` stamp
pair per step and every untraced arm none. The garbage collector is off inside timed regions.

Usage::

    .venv/bin/python bench/async_instrument.py                        # 10000 steps x 15 repeats
    .venv/bin/python bench/async_instrument.py --steps 20000 --repeats 31 --mode sync

The last line is ``untraced_us_per_step=... traced_us_per_step=... added_us_per_step=...
added_us_per_call=...``: medians over repeats; the added figures are medians of the per-repeat
differences (the two arms of a repeat ran back to back).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from otel_kvtrace.asynccheck.instrument import EngineLoopInstrumentation
from otel_kvtrace.asynccheck.recorder import StampBuffer, StampKind
from otel_kvtrace.asynccheck.replica import (
    MODES,
    REPLICA_OWNERS,
    ReplicaConfig,
    ReplicaEngineCore,
    ReplicaScheduler,
    VirtualClock,
)

WRAPPED_PER_STEP = 5
"""Wrapped methods one async/sync engine step passes through (the DP all-reduce is off here)."""


@dataclass(slots=True)
class RepeatResult:
    """One repeat: both arms of the engine loop and of the per-call loop, in ns of thread CPU time."""

    untraced_step_ns: float
    traced_step_ns: float
    untraced_call_ns: float
    traced_call_ns: float
    traced_first: bool


def _timed(body: Callable[[], object]) -> int:
    """Thread CPU ns of ``body()`` with the collector off (a collection lands in either arm at random)."""
    gc.collect()
    gc.disable()
    try:
        start = time.thread_time_ns()
        body()
        return time.thread_time_ns() - start
    finally:
        gc.enable()


def _stamp_count(buffer: StampBuffer, kind: StampKind) -> int:
    return sum(1 for s in buffer.drain(settle_s=0) if s.kind == kind)


def _engine_arm(cfg: ReplicaConfig, traced: bool, stamp_clock: str) -> float:
    """CPU ns per step of ``ReplicaEngineCore.run()`` for ``cfg.num_steps`` steps."""
    clock = VirtualClock()
    capacity = cfg.num_steps * (8 + 2 * cfg.layers) + 64  # run_replica's sizing: no drops
    buffer = StampBuffer(capacity=capacity, clock=clock if stamp_clock == "virtual" else time.perf_counter_ns)
    engine = ReplicaEngineCore(clock, buffer, cfg)
    instrumentation = EngineLoopInstrumentation(buffer, owners=REPLICA_OWNERS) if traced else None
    if instrumentation is not None:
        instrumentation.install()
    try:
        elapsed = _timed(engine.run)
    finally:
        if instrumentation is not None:
            instrumentation.uninstall()
    schedules = _stamp_count(buffer, StampKind.SCHED_BEGIN)
    expected = cfg.num_steps if traced else 0
    if schedules != expected or buffer.dropped:
        raise RuntimeError(
            f"{'traced' if traced else 'untraced'} engine arm recorded {schedules} schedule stamps "
            f"(expected {expected}) and dropped {buffer.dropped}: the measurement is not what it claims"
        )
    return elapsed / cfg.num_steps


def _call_arm(cfg: ReplicaConfig, calls: int, traced: bool, stamp_clock: str) -> float:
    """CPU ns per ``scheduler.schedule()`` call, looked up and bound each time as the engine does."""
    clock = VirtualClock()
    buffer = StampBuffer(capacity=2 * calls + 64, clock=clock if stamp_clock == "virtual" else time.perf_counter_ns)
    scheduler = ReplicaScheduler(clock, cfg)
    instrumentation = EngineLoopInstrumentation(buffer, owners=REPLICA_OWNERS) if traced else None

    def loop() -> None:
        s = scheduler
        for _ in range(calls):
            s.schedule()

    if instrumentation is not None:
        instrumentation.install()
    try:
        elapsed = _timed(loop)
    finally:
        if instrumentation is not None:
            instrumentation.uninstall()
    schedules = _stamp_count(buffer, StampKind.SCHED_BEGIN)
    if schedules != (calls if traced else 0) or buffer.dropped:
        raise RuntimeError(f"per-call arm recorded {schedules} schedule stamps, dropped {buffer.dropped}")
    return elapsed / calls


def measure(cfg: ReplicaConfig, calls: int, repeats: int, stamp_clock: str) -> list[RepeatResult]:
    """Alternate the arms ``repeats`` times after one untimed warm-up of each."""
    warm = ReplicaConfig(mode=cfg.mode, num_steps=min(cfg.num_steps, 500), layers=cfg.layers)
    for traced in (False, True):
        _engine_arm(warm, traced, stamp_clock)
        _call_arm(warm, min(calls, 5000), traced, stamp_clock)
    results = []
    for i in range(repeats):
        traced_first = i % 2 == 1
        order = (True, False) if traced_first else (False, True)
        step_ns = {traced: _engine_arm(cfg, traced, stamp_clock) for traced in order}
        call_ns = {traced: _call_arm(cfg, calls, traced, stamp_clock) for traced in order}
        r = RepeatResult(step_ns[False], step_ns[True], call_ns[False], call_ns[True], traced_first)
        results.append(r)
        print(
            f"repeat {i + 1:>3}/{repeats} {'traced-first  ' if traced_first else 'untraced-first'} "
            f"untraced_us_per_step={r.untraced_step_ns / 1e3:.2f} traced_us_per_step={r.traced_step_ns / 1e3:.2f} "
            f"added_us_per_step={(r.traced_step_ns - r.untraced_step_ns) / 1e3:.2f} "
            f"ratio={r.traced_step_ns / r.untraced_step_ns:.2f} | "
            f"untraced_us_per_call={r.untraced_call_ns / 1e3:.3f} traced_us_per_call={r.traced_call_ns / 1e3:.3f} "
            f"added_us_per_call={(r.traced_call_ns - r.untraced_call_ns) / 1e3:.3f}",
            flush=True,
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10000, help="engine steps per arm per repeat (default 10000)")
    parser.add_argument("--repeats", type=int, default=15, help="alternating repeats (default 15)")
    parser.add_argument("--calls", type=int, default=50000, help="schedule() calls per arm per repeat (default 50000)")
    parser.add_argument("--mode", choices=MODES, default="async", help="replica engine loop (default async)")
    parser.add_argument("--layers", type=int, default=4, help="device layers per step (default 4, the replica's)")
    parser.add_argument(
        "--stamp-clock", choices=("real", "virtual"), default="real",
        help="stamp time source: perf_counter_ns as in vLLM (default) or the replica's virtual clock",
    )
    args = parser.parse_args()
    for name in ("steps", "repeats", "calls", "layers"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    cfg = ReplicaConfig(mode=args.mode, num_steps=args.steps, layers=args.layers)
    print(
        f"# replica mode={cfg.mode} steps={cfg.num_steps} layers={cfg.layers} calls={args.calls} "
        f"repeats={args.repeats} stamp_clock={args.stamp_clock} python={sys.version.split()[0]}; "
        f"host CPU time (thread_time_ns), {WRAPPED_PER_STEP} wrapped methods per step",
        flush=True,
    )
    results = measure(cfg, args.calls, args.repeats, args.stamp_clock)
    untraced = statistics.median(r.untraced_step_ns for r in results) / 1e3
    traced = statistics.median(r.traced_step_ns for r in results) / 1e3
    added_step = statistics.median(r.traced_step_ns - r.untraced_step_ns for r in results) / 1e3
    added_call = statistics.median(r.traced_call_ns - r.untraced_call_ns for r in results) / 1e3
    ratios = sorted(r.traced_step_ns / r.untraced_step_ns for r in results)
    print(
        f"# medians over {len(results)} repeats; added = median of per-repeat differences; "
        f"step ratio median {statistics.median(ratios):.2f} (range {ratios[0]:.2f}-{ratios[-1]:.2f}); "
        f"schedule() untraced {statistics.median(r.untraced_call_ns for r in results) / 1e3:.3f} us/call"
    )
    print(
        f"untraced_us_per_step={untraced:.2f} traced_us_per_step={traced:.2f} "
        f"added_us_per_step={added_step:.2f} added_us_per_call={added_call:.3f}"
    )


if __name__ == "__main__":
    main()
