"""Does the per-step resource sampler slow the serving engine? Engine step time with and without it.

Runs ``otel_kvtrace.serve.engine.ReplicaEngine`` (hol preset, untraced) in-process: each repeat serves the
same burst of requests twice, once with a ``ResourceSampler`` polling every 2 ms (the ``serve-replica``
default) and once without, the arms alternating which goes first. Measured: the median engine step time
(wall clock: the replica's forward sleeps on the real clock, so added GIL contention from the sampler
shows up as longer steps) and, for the sampler arm, the sampler thread's CPU time per step.

Usage::

    .venv/bin/python bench/serve_resources.py                 # 7 repeats x 16 requests x 32 tokens
    .venv/bin/python bench/serve_resources.py --repeats 11 --requests 32

The last line is ``off_step_ms=... on_step_ms=... ratio=... sampler_cpu_us_per_step=...`` (medians over
repeats; ratio = on / off).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time

from otel_kvtrace.demo import PRESETS
from otel_kvtrace.resources.sampler import ResourceSampler
from otel_kvtrace.serve.engine import EngineRequest, ReplicaEngine


def serve_burst(requests: int, tokens: int, sampler_on: bool, tmp: str) -> tuple[float, float]:
    """Median step ms of one burst, and the sampler's CPU us per step (0 without it)."""
    engine = ReplicaEngine(PRESETS["hol"], max_num_seqs=8)
    sampler = ResourceSampler(engine.worker, tmp, f"bench-{time.time_ns()}") if sampler_on else None
    if sampler is not None:
        engine.on_step = sampler.notify_step
    engine.start()
    if sampler is not None:
        sampler.start()
    left = threading.Semaphore(0)
    for i in range(requests):
        engine.submit(EngineRequest(f"r{i}", 1024, tokens, lambda idx, _ns, n=tokens: left.release() if idx == n - 1 else None))
    for _ in range(requests):
        left.acquire()
    engine.stop()
    if sampler is not None:
        sampler.stop()
    steps = list(engine.stats.step_ns)
    cpu_ns = sampler.cpu_ns if sampler is not None else 0
    return statistics.median(steps) / 1e6, cpu_ns / 1e3 / max(1, engine.stats.steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    off, on, cpu = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.repeats):
            for arm in ((False, True) if k % 2 == 0 else (True, False)):
                step_ms, cpu_us = serve_burst(args.requests, args.tokens, arm, tmp)
                (on if arm else off).append(step_ms)
                if arm:
                    cpu.append(cpu_us)
            print(f"repeat {k}: off {off[-1]:.3f} ms  on {on[-1]:.3f} ms  sampler {cpu[-1]:.1f} us/step", flush=True)
    o, n = statistics.median(off), statistics.median(on)
    print(f"off_step_ms={o:.3f} on_step_ms={n:.3f} ratio={n / o:.3f} sampler_cpu_us_per_step={statistics.median(cpu):.1f}")


if __name__ == "__main__":
    main()
