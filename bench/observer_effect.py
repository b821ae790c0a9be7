"""How much tracing slows the forward: the REAL vLLM-Ascend recv thread serving a CPU-bound forward thread.

The released sdist (or ``KVTRACE_UPSTREAM_SRC``) is imported like the conformance tests do
(``tests/upstream/harness.py``). A forward-like thread runs steps of ``--layers`` layers; per layer it
enqueues the next layer's ``LayerLoadTask`` (prefetch 1, attention gate recorded, source save done),
does ``--work-us`` of pure-Python CPU work (the per-layer Python of a forward), then waits for this
layer's load event, as ``wait_for_layer_load`` does. The real recv thread (same process, same GIL)
serves the tasks. The measured quantity is the forward's step time.

Modes, alternating in rounds: ``off`` (untraced), ``agent`` (default export: shared-memory ring +
exporter agent process), ``thread`` (the in-process exporter thread), ``wrappers`` (``agent`` with
``OTEL_KVTRACE_PROBES=wrappers``: one wrapper/proxy per recv stage instead of the compiled probes). The slowdown of a mode in a round
is its mean step time over the ``off`` mean of the same round (each over ``--seconds``, several export
intervals, so the in-process exporter's bursts are inside the window); the table shows the median over
rounds. ``--compete`` adds a run under one competing CPU-bound process.

Usage::

    .venv/bin/python bench/observer_effect.py                       # 1000 and 150 us per layer, idle
    .venv/bin/python bench/observer_effect.py --compete --rounds 5

Last line: ``forward_slowdown_pct=<median>``: the agent mode at the smallest ``--work-us``, idle.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from upstream_overhead import _load_harness  # noqa: E402  (one loader of the upstream harness)

MODES = ("off", "agent", "thread", "wrappers")


def _burn(us: int) -> None:
    """Pure-Python CPU work for ``us`` microseconds of this thread's CPU time (holds the GIL like a forward)."""
    end = time.thread_time_ns() + us * 1000
    x = 0
    while time.thread_time_ns() < end:
        for i in range(20):
            x += i


def _steps(up: Any, env: Any, steps: int, work_us: int, out: list[int], seconds: float = 0.0) -> None:
    """``steps`` steps, or as many as fit in ``seconds`` when that is longer; step times into ``out``."""
    layers = env.num_layers
    request = up.request("r-fwd", 16)

    shared = [None]

    def enqueue(layer: int) -> None:
        gate = up.gate_class()
        gate.record()
        if layer:
            env.save_done[layer - 1].set()
        else:  # one SharedBlockData per step, on every layer's task, as upstream builds them
            shared[0] = up.shared_data([request])
        env.thread.add_request(up.gva_task(layer, [request], wait_for_save_layer=layer - 1 if layer else None,
                                           gate=gate, shared=shared[0]))

    end = time.perf_counter() + seconds
    n_steps = 0
    while n_steps < steps or time.perf_counter() < end:
        n_steps += 1
        t0 = time.perf_counter_ns()
        enqueue(0)
        for layer in range(layers):
            if layer + 1 < layers:
                enqueue(layer + 1)
            _burn(work_us)
            done = env.load_done[layer]
            if not done.wait(10):
                raise RuntimeError(f"layer {layer} never loaded")
            done.clear()
        out.append(time.perf_counter_ns() - t0)
        for ev in env.save_done:
            ev.clear()


def run(work_us: int, rounds: int, steps: int, layers: int, seconds: float) -> dict[str, list[float]]:
    """Per mode, per round: the mean step time (ns) over at least ``seconds``.

    The mean, not the median: the in-process exporter works in bursts (every export interval), and
    the slowdown that matters is the forward's throughput, bursts included. The window must span
    several export intervals, or the in-process exporter would do its work between windows."""
    from upstream_overhead import _start

    h = _load_harness()
    medians: dict[str, list[float]] = {m: [] for m in MODES}
    with h.upstream_session(h.upstream_source_dir()) as up, tempfile.TemporaryDirectory(prefix="kvtrace-oe-") as tmp:
        targets = up.binding.to_targets()
        for _ in range(rounds):
            for mode in MODES:
                session = _start(targets, {"off": "untraced", "agent": "traced+agent", "thread": "traced+thread",
                                           "wrappers": "wrappers+agent"}[mode], tmp, "oe")
                env = up.gva_thread(layers, h.FakeBackend())
                warm: list[int] = []
                _steps(up, env, 2, work_us, warm)
                times: list[int] = []
                forward = threading.Thread(target=_steps, args=(up, env, steps, work_us, times, seconds),
                                           name="forward")
                forward.start()
                forward.join()
                medians[mode].append(statistics.fmean(times))
                if session is not None:
                    stats = session.shutdown()
                    if stats.disabled_reason:
                        raise RuntimeError(f"tracing disabled itself: {stats.disabled_reason}")
    return medians


def _slowdowns(medians: dict[str, list[float]], mode: str) -> list[float]:
    return [100.0 * (m / b - 1.0) for m, b in zip(medians[mode], medians["off"], strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-us", type=int, nargs="+", default=[1000, 150], help="per-layer work (default 1000 150)")
    parser.add_argument("--rounds", type=int, default=7, help="alternating rounds (default 7)")
    parser.add_argument("--steps", type=int, default=5, help="at least this many steps per mode per round")
    parser.add_argument("--seconds", type=float, default=1.0,
                        help="and at least this long per mode per round (default 1.0: 5 export intervals)")
    parser.add_argument("--layers", type=int, default=32, help="layers per step (default 32)")
    parser.add_argument("--compete", action="store_true", help="also run under a competing CPU-bound process")
    args = parser.parse_args()
    if min(args.work_us) < 1 or args.rounds < 1 or args.steps < 1 or args.layers < 2:
        parser.error("--work-us, --rounds, --steps must be >= 1 and --layers >= 2")
    loads = ["idle", "compete"] if args.compete else ["idle"]
    headline = None
    print(f"{'load':8} {'work/layer':>10} {'step off ms':>12} {'agent %':>8} {'agent range':>16} {'thread %':>9} "
          f"{'thread range':>16} {'wrappers %':>10} {'wrappers range':>16}")
    for load in loads:
        hog = None
        if load == "compete":
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            for work in args.work_us:
                med = run(work, args.rounds, args.steps, args.layers, args.seconds)
                agent, thread = _slowdowns(med, "agent"), _slowdowns(med, "thread")
                wrapped = _slowdowns(med, "wrappers")
                print(f"{load:8} {work:>8}us {statistics.median(med['off']) / 1e6:12.2f} "
                      f"{statistics.median(agent):8.2f} {min(agent):7.2f}..{max(agent):<7.2f} "
                      f"{statistics.median(thread):9.2f} {min(thread):7.2f}..{max(thread):<7.2f} "
                      f"{statistics.median(wrapped):10.2f} {min(wrapped):7.2f}..{max(wrapped):<7.2f}", flush=True)
                if load == "idle" and work == min(args.work_us):
                    headline = statistics.median(agent)
        finally:
            if hog is not None:
                hog.kill()
                hog.wait()
    print("(slowdown: per round, mean step time of the mode over the untraced mean; median over rounds)")
    print(f"forward_slowdown_pct={headline:.2f}")


if __name__ == "__main__":
    main()
