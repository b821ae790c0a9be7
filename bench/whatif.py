"""What-if replay speed: 1M recv tasks replayed under fifo, ready_queue and gate_group (target <= 60 s).

The tasks follow the upstream layout (main, GVA): per step N layers, the first P loaded at c=0 (layers
1..P-1 share gate G_0), then one task per forward layer gated by G_{l-P+1}; layers >= B+1 reuse the slot
of l-B (save dependency); layer N-1 is the final-layer task. Times are random (seeded): arrivals,
forward compute gaps, save/gate/slot readiness, work segments, plus one non-prefix independent layer
per step that is ready early but sits behind a reused layer (so the policies really differ). The tasks
are split over several queues (ranks), as in a real deployment.

Prints per policy: seconds (median of ``--repeat`` runs), tasks/s and the ratio to FIFO; then the time
to build the columns. Last line (machine-readable):
``tasks=1000000 fifo_s=.. ready_queue_s=.. gate_group_s=.. total_s=..``

Run:  .venv/bin/python bench/whatif.py [--tasks 1000000] [--queues 4] [--repeat 1]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from otel_kvtrace.whatif.engine import QueueArrays, replay_queue
from otel_kvtrace.whatif.policy import get_policy
from otel_kvtrace.whatif.task import ReplayTask

POLICIES = ("fifo", "ready_queue", "gate_group")


def make_queue(queue: str, tasks: int, *, layers: int = 32, prefetch: int = 4, buffers: int = 8,
               seed: int = 0) -> list[ReplayTask]:
    """``tasks`` recv tasks of one queue (whole steps), with consistent dependencies."""
    rng = random.Random(seed)
    out: list[ReplayTask] = []
    t = 0
    seq = 0
    step = 0
    indep = layers // 2  # a non-prefix independent layer: no save dependency
    while seq < tasks:
        step_start = t
        fwd = step_start + 50_000
        arrive_fwd = []
        for layer in range(layers):
            arrive_fwd.append(fwd)
            fwd += rng.randint(400_000, 700_000)
        for layer in range(layers):
            if seq >= tasks:
                break
            c = 0 if layer < prefetch else layer - prefetch + 1
            arrival = step_start if layer < prefetch else arrive_fwd[c]
            gate = None if layer == 0 else c
            src = layer - buffers if layer >= buffers + 1 and layer != indep else None
            rec_complete = arrive_fwd[layer] + rng.randint(0, 200_000)
            out.append(ReplayTask(
                queue=queue, seq=seq, step=step, layer_id=layer, arrival_ns=arrival,
                work_ns=(rng.randint(5_000, 30_000), rng.randint(10_000, 40_000), rng.randint(0, 10_000),
                         rng.randint(300_000, 900_000)),
                wake_ns=(rng.randint(0, 20_000), rng.randint(0, 20_000), 0),
                ready_save_ns=arrive_fwd[src] + rng.randint(600_000, 3_000_000) if src is not None else None,
                ready_gate_ns=arrive_fwd[c] + rng.randint(50_000, 300_000) if gate is not None else None,
                ready_slot_ns=arrival + rng.randint(0, 2_000_000) if rng.random() < 0.05 else None,
                final_layer=layer == layers - 1, gate_id=gate, wait_for_save_layer=src,
                completion_ns=5_000, backend_submit_ns=rng.randint(300_000, 900_000),
                bytes=rng.randint(1, 64) * 65536, recorded_complete_ns=rec_complete,
                consumer_wait_start_ns=arrive_fwd[layer], consumer_wait_end_ns=max(arrive_fwd[layer], rec_complete),
            ))
            seq += 1
        t = fwd + 200_000
        step += 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=1_000_000)
    ap.add_argument("--queues", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    if args.tasks < args.queues or args.queues < 1 or args.repeat < 1:
        ap.error("--tasks must be >= --queues >= 1 and --repeat >= 1")
    per_queue = args.tasks // args.queues
    sizes = [per_queue] * args.queues
    sizes[-1] += args.tasks - per_queue * args.queues
    t0 = time.perf_counter()
    queues = [make_queue(f"q{k}", n, seed=k) for k, n in enumerate(sizes)]
    gen_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    arrays = [QueueArrays.from_tasks(q) for q in queues]
    build_s = time.perf_counter() - t0
    print(f"generated {args.tasks} tasks in {args.queues} queue(s): {gen_s:.1f} s; columns built in {build_s:.1f} s")
    seconds: dict[str, float] = {}
    makespan: dict[str, int] = {}
    for name in POLICIES:
        runs = []
        for _ in range(args.repeat):
            policy = get_policy(name)
            t0 = time.perf_counter()
            reps = [replay_queue(a, policy) for a in arrays]
            runs.append(time.perf_counter() - t0)
        seconds[name] = statistics.median(runs)
        makespan[name] = sum(max(r.complete) for r in reps)
        del reps
    base = seconds["fifo"]
    print(f"{'policy':<12} {'seconds':>8} {'tasks/s':>12} {'x fifo':>7}  replayed makespan vs fifo")
    for name in POLICIES:
        s = seconds[name]
        print(f"{name:<12} {s:>8.2f} {args.tasks / s:>12,.0f} {s / base:>7.2f}  "
              f"{makespan[name] / makespan['fifo']:.4f}")
    total = sum(seconds.values())
    print(f"total replay {total:.1f} s (target <= 60 s)")
    print(f"tasks={args.tasks} fifo_s={seconds['fifo']:.2f} ready_queue_s={seconds['ready_queue']:.2f} "
          f"gate_group_s={seconds['gate_group']:.2f} total_s={total:.2f}")


if __name__ == "__main__":
    main()
