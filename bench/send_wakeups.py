"""Where the replica's metadata-build sleep goes, per thread and layer, under FIFO and under a live policy.

The threaded replica stands in for upstream's address build with a sleep of the planned time (``hol``:
20 us; ``FakeTokenDatabase.spend_meta_build``). On this VM such a sleep takes 75-160 us, and what it takes
depends on what the other threads do when it ends, which a policy changes. This bench times every such
sleep in two parts, with a tiny C helper built with ``gcc`` (called through ``ctypes``, which releases the
GIL around it): the **OS wake-up** (from the requested end to the moment the thread runs again, read in
C before the GIL is taken back) and the **GIL re-take** (from then until Python code runs again). The
send thread's saves 4-6 of ``hol`` are what decides the final layer under ``ready_queue``
(docs/whatif.md, "What is left"): their pre-sync phase is this sleep plus a little Python.

Policies run alternately (ABBA over ``--rounds``), each round one ``kvtrace demo --preset hol`` run of
``--steps`` steps on real threads, traced as the demo is (the in-process default). Printed per thread and
layer: the median OS wake-up and GIL re-take under each policy, and the policy's minus FIFO's. A
diagnostic, not a prediction: nothing here is read by the what-if.

Usage::

    .venv/bin/python bench/send_wakeups.py                       # fifo vs ready_queue, 4 rounds x 60 steps (~1 min)
    .venv/bin/python bench/send_wakeups.py --rounds 8 --steps 80 --threads send
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

HELPER_C = r"""
#include <time.h>
/* Sleep ns with the GIL released (ctypes drops it), then read CLOCK_MONOTONIC (perf_counter_ns's clock)
   before returning, i.e. before the caller takes the GIL back. */
long long kv_sleep_then_now(long long ns) {
    struct timespec ts = {ns / 1000000000LL, ns % 1000000000LL}, now;
    while (nanosleep(&ts, &ts) != 0) {}
    clock_gettime(CLOCK_MONOTONIC, &now);
    return now.tv_sec * 1000000000LL + now.tv_nsec;
}
"""

Samples = dict[tuple[str, int], list[tuple[int, int]]]
"""(thread, layer) -> (OS wake-up ns past the requested end, GIL re-take ns) per sleep."""


def build_helper(tmp: Path) -> Callable[[int], int]:
    """The C helper, compiled here (needs ``gcc``)."""
    src, lib = tmp / "kv_sleep.c", tmp / "kv_sleep.so"
    src.write_text(HELPER_C)
    try:
        subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        sys.exit(f"error: cannot build the sleep helper with gcc ({exc}); this bench needs a C compiler")
    fn = ctypes.CDLL(str(lib)).kv_sleep_then_now
    fn.restype, fn.argtypes = ctypes.c_longlong, [ctypes.c_longlong]
    return fn


def timed_meta_build(sleep_then_now: Callable[[int], int], samples: Samples) -> Callable:
    """A ``spend_meta_build`` that sleeps the planned time through the helper and records both parts."""

    def spend_meta_build(self, step: int, layer: int) -> int:  # noqa: ANN001 (the replica's signature)
        index, cost = self.planned_meta_build(step, layer)
        if cost:
            t0 = time.perf_counter_ns()
            woke = sleep_then_now(cost)
            ran = time.perf_counter_ns()
            who = "send" if "Send" in threading.current_thread().name else "recv"
            samples[(who, layer)].append((woke - t0 - cost, ran - woke))
        return index

    return spend_meta_build


def run_round(policy: str, steps: int, seed: int, out: Path) -> None:
    """One traced ``hol`` demo run under ``policy``."""
    from otel_kvtrace.demo import run_demo

    run_demo("hol", steps=steps, seed=seed, scheduler=policy, out=out / f"{policy}-{seed}")


def median_us(xs: list[int]) -> float:
    """Median in us (nan when a layer had no sleep under a policy)."""
    return statistics.median(xs) / 1e3 if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog="Example: bench/send_wakeups.py --policy ready_queue --rounds 8")
    ap.add_argument("--policy", default="ready_queue", help="the live policy set against fifo (default ready_queue)")
    ap.add_argument("--rounds", type=int, default=4, help="runs per policy, alternating ABBA (default 4)")
    ap.add_argument("--steps", type=int, default=60, help="steps per run (default 60)")
    ap.add_argument("--threads", nargs="+", choices=("send", "recv"), default=["send", "recv"])
    args = ap.parse_args()
    if args.rounds < 1 or args.steps < 1:
        ap.error("--rounds and --steps must be at least 1")
    import otel_kvtrace.replica.backend as backend
    from otel_kvtrace.schedule import SCHEDULERS

    if args.policy not in SCHEDULERS or args.policy == "fifo":
        ap.error(f"--policy must be one of {', '.join(n for n in SCHEDULERS if n != 'fifo')}")
    per: dict[str, Samples] = {"fifo": defaultdict(list), args.policy: defaultdict(list)}
    original = backend.FakeTokenDatabase.spend_meta_build
    with tempfile.TemporaryDirectory() as tmp:
        helper = build_helper(Path(tmp))
        try:
            for r in range(args.rounds):
                pair = ("fifo", args.policy) if r % 2 == 0 else (args.policy, "fifo")
                for policy in pair:
                    backend.FakeTokenDatabase.spend_meta_build = timed_meta_build(helper, per[policy])
                    run_round(policy, args.steps, r, Path(tmp))
                print(f"# round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        finally:
            backend.FakeTokenDatabase.spend_meta_build = original
    p = args.policy
    print(f"# hol, {args.rounds} runs x {args.steps} steps per policy; medians in us of each meta-build sleep "
          f"(planned 20 us): OS wake-up past the planned end, then GIL re-take")
    print(f"{'thread':6} {'layer':>5}  {'fifo OS':>8} {p + ' OS':>15} {'diff':>6}   {'fifo GIL':>8} {p + ' GIL':>16} {'diff':>6}")
    for who in args.threads:
        layers = sorted({layer for (w, layer) in per["fifo"] if w == who})
        for layer in layers:
            a, b = per["fifo"][(who, layer)], per[p][(who, layer)]
            os_a, os_b = median_us([x for x, _ in a]), median_us([x for x, _ in b])
            gil_a, gil_b = median_us([y for _, y in a]), median_us([y for _, y in b])
            print(f"{who:6} {layer:5d}  {os_a:8.1f} {os_b:15.1f} {os_b - os_a:+6.1f}   {gil_a:8.1f} {gil_b:16.1f} "
                  f"{gil_b - gil_a:+6.1f}")


if __name__ == "__main__":
    main()
