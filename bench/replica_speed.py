"""How fast the virtual-clock replica simulates, and how it compares with the threaded real-clock one.

Part 1: ``simulate(cfg)`` throughput in simulated tasks per second (recv + save tasks, the records a
trace would hold), median of repeats, for several layouts. The target is >= 200,000 tasks/s.
Part 2: the same small config on both engines, side by side: wall time per step and the ratio.

Run:  .venv/bin/python bench/replica_speed.py [--repeats 5] [--steps 500]
"""

from __future__ import annotations

import argparse
import statistics
import time

from otel_kvtrace.replica.config import ReplicaConfig, SlowInjection, Timing
from otel_kvtrace.replica.simulate import simulate
from otel_kvtrace.replica.threaded import run_threaded

TARGET_TASKS_PER_S = 200_000


def layouts(steps: int) -> dict[str, ReplicaConfig]:
    return {
        "main N=64 B=4 P=4 indep=0,4": ReplicaConfig(
            num_layers=64, num_shared_buffers=4, prefetch_layers=4, independent_layers=(0, 4), steps=steps),
        "main N=64 uniform (B=N, P=8)": ReplicaConfig(num_layers=64, steps=steps),
        "main N=61 B=2 buckets=aab jitter": ReplicaConfig(
            num_layers=61, num_shared_buffers=2, bucket_pattern="aab", steps=steps,
            timing=Timing(jitter="lognormal"), slow=SlowInjection(slow_save_layers=(3,), slow_save_us=2000)),
        "v0.23 N=64 P=1": ReplicaConfig(behaviour="v0.23", num_layers=64, steps=steps),
        "key N=64 P=1": ReplicaConfig(path="key", num_layers=64, steps=steps),
    }


def sweep_sized(runs: int) -> tuple[float, float]:
    """What a sweep cell costs: many small runs (N=8, 4 steps, jitter), fixed per-run costs included."""
    cfg = ReplicaConfig(num_layers=8, num_shared_buffers=2, prefetch_layers=4, independent_layers=(0, 4), steps=4,
                        timing=Timing(jitter="lognormal"))
    c0 = time.process_time_ns()
    tasks = 0
    for seed in range(runs):
        tasks += simulate(cfg.with_(seed=seed)).num_tasks
    cpu = time.process_time_ns() - c0
    return tasks / (cpu / 1e9), cpu / runs / 1e3


def throughput(cfg: ReplicaConfig, repeats: int) -> tuple[float, float, int, float]:
    """Median simulated tasks per CPU second and per wall second, tasks per run, simulated/wall time.

    CPU time (``time.process_time_ns``) is the figure to compare: on a shared machine wall time also
    counts the time other processes held the core.
    """
    cpu_rates, wall_rates, speedups = [], [], []
    tasks = 0
    for _ in range(repeats):
        c0, t0 = time.process_time_ns(), time.perf_counter_ns()
        res = simulate(cfg)
        cpu, wall = time.process_time_ns() - c0, time.perf_counter_ns() - t0
        tasks = res.num_tasks
        cpu_rates.append(tasks / (max(cpu, 1) / 1e9))
        wall_rates.append(tasks / (wall / 1e9))
        speedups.append(res.end_ns / wall)
    return statistics.median(cpu_rates), statistics.median(wall_rates), tasks, statistics.median(speedups)


def side_by_side(repeats: int) -> None:
    cfg = ReplicaConfig(num_layers=8, num_shared_buffers=2, prefetch_layers=4, independent_layers=(0, 4), steps=20)
    virtual, threaded, predicted, measured = [], [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        res = simulate(cfg)
        virtual.append((time.perf_counter_ns() - t0) / cfg.steps)
        predicted.append(statistics.median(s.end_ns - s.start_ns for s in res.steps))
        t0 = time.perf_counter_ns()
        real = run_threaded(cfg)
        threaded.append((time.perf_counter_ns() - t0) / cfg.steps)
        measured.append(statistics.median(real.step_ns))
    v, t = statistics.median(virtual), statistics.median(threaded)
    p, m = statistics.median(predicted), statistics.median(measured)
    print(f"\nSame config ({cfg.label}, {cfg.steps} steps), median of {repeats}:")
    print(f"  wall time to run one step: virtual {v / 1e3:9.1f} us   threaded {t / 1e3:9.1f} us"
          f"   ratio {t / v:6.1f}x")
    print(f"  step duration: virtual engine predicts {p / 1e6:7.3f} ms, threaded replica measured {m / 1e6:7.3f} ms"
          f"   ratio measured/predicted {m / p:5.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=500)
    args = parser.parse_args()
    print(f"Virtual-clock replica, {args.steps} steps, median of {args.repeats} runs")
    print(f"{'layout':38s} {'tasks/run':>10s} {'tasks/cpu-s':>12s} {'tasks/wall-s':>13s} {'sim/wall':>9s}"
          f"  target {TARGET_TASKS_PER_S:,}/cpu-s")
    for name, cfg in layouts(args.steps).items():
        cpu_rate, wall_rate, tasks, speed = throughput(cfg, args.repeats)
        ok = "ok" if cpu_rate >= TARGET_TASKS_PER_S else "BELOW"
        print(f"{name:38s} {tasks:10d} {cpu_rate:12,.0f} {wall_rate:13,.0f} {speed:8.1f}x  {ok}")
    rate, per_run_us = sweep_sized(300)
    print(f"{'sweep-sized: N=8 B=2 P=4, 4 steps, 300 runs':38s} {64:10d} {rate:12,.0f} {'':13s} {'':9s}"
          f"  {per_run_us:.0f} us CPU per run (fixed setup included)")
    side_by_side(args.repeats)


if __name__ == "__main__":
    main()
