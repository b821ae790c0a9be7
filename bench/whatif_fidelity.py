"""What-if fidelity: the ready_queue gain the what-if predicts from FIFO runs vs the gain measured with
the live scheduler switched on (``otel_kvtrace.schedule``), same workloads, same seeds.

Per configuration (threaded replica presets on the real clock: ``hol`` = slow save, ``slow-slot`` = slow
external slot release, ``buckets`` = several cache-spec buckets with a slow save): for each seed, one
traced FIFO run and one traced ready_queue run, alternated so machine drift hits both alike. Then
``whatif(FIFO runs, measured=[ready_queue runs])`` predicts the gain from the FIFO runs and reads the
measured one from the ready_queue runs (``otel_kvtrace.whatif.measured``).

gain error = |predicted - measured| mean TTFT gain in % of max(|measured gain|, noise), noise = the larger
run-to-run stdev of the two policies' measured mean TTFT. Last line: ``max_gain_error_pct=<x> cells=<n>``.

Usage::

    .venv/bin/python bench/whatif_fidelity.py                 # 3 presets x 3 seeds x 2 policies
    .venv/bin/python bench/whatif_fidelity.py --seeds 5 --steps 60
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

PRESETS = ("hol", "slow-slot", "buckets")


def record(preset: str, seeds: int, steps: int, out: Path, cpu: dict[str, list[float]]) -> tuple[Path, Path]:
    """Traced FIFO and ready_queue runs of ``preset``, alternated per seed; process CPU ms per step
    of each run goes to ``cpu[scheduler]`` (the recv thread's idle cost shows up here)."""
    from otel_kvtrace.demo import run_demo

    fifo, rq = out / preset / "fifo", out / preset / "ready_queue"
    for seed in range(1, seeds + 1):
        for scheduler, where in (("fifo", fifo), ("ready_queue", rq)):
            c0 = time.process_time()
            run_demo(preset, seed=seed, steps=steps, scheduler=scheduler, out=where)
            cpu.setdefault(scheduler, []).append((time.process_time() - c0) * 1e3 / steps)
    return fifo / "traces", rq / "traces"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--presets", nargs="*", default=list(PRESETS))
    args = ap.parse_args()
    from otel_kvtrace.whatif.api import whatif

    rows = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvtrace-fidelity-") as tmp:
        for preset in args.presets:
            cpu: dict[str, list[float]] = {}
            fifo, rq = record(preset, args.seeds, args.steps, Path(tmp), cpu)
            report = whatif([fifo], measured=[rq], policies=["ready_queue"])
            for v in report.verdicts:
                for c in v.extra.get("measured", []):
                    rows.append((preset, c, v.verdict, cpu))
            print(f"# {preset}: done at {time.perf_counter() - t0:.0f} s", flush=True)
    print(f"{'config':10} {'FIFO ms':>8} {'pred gain':>9} {'meas gain':>9} {'noise':>6} {'err %':>7} "
          f"{'CPU ms/step fifo/rq':>20}  predicted verdict / measured verdict")
    worst = 0.0
    for preset, c, predicted_verdict, cpu in rows:
        worst = max(worst, c["gain_error_pct"])
        cpu_text = f"{statistics.median(cpu['fifo']):.2f}/{statistics.median(cpu['ready_queue']):.2f}"
        print(f"{preset:10} {c['fifo_measured']['ttft_ms_mean']['mean']:8.3f} {c['predicted_gain_ms']:9.3f} "
              f"{c['measured_gain_ms']:9.3f} {c['noise_ms']:6.3f} {c['gain_error_pct']:7.1f} {cpu_text:>20}  "
              f"{predicted_verdict} / {c['verdict']}")
    print(f"max_gain_error_pct={worst:.1f} cells={len(rows)}")


if __name__ == "__main__":
    main()
