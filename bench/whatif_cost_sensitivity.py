"""How the what-if's error on kept fidelity traces moves with a per-dequeue cost of the live policy.

``bench/whatif_fidelity.py --keep DIR`` keeps each cell's FIFO and policy runs. This replays every kept
cell's FIFO runs again with the policy charged ``X`` us per dequeue (the replay's ``dispatch_ns``: on the
served task's start, and through ``gil.py`` on the forward's wake-up lag behind the recv thread) for each
``--costs`` value, and prints the predicted gain and its error against the measured gain of the kept
policy runs (``gain_error_pct``, the bench's ``err %``). It answers whether one cost per dequeue could
explain a cell's miss (docs/whatif.md, "Latest table: 2026-12-06"); it is not a prediction (the cost is
swept, not derived).

Usage::

    .venv/bin/python bench/whatif_fidelity.py --keep /tmp/fid          # once (~15 min)
    .venv/bin/python bench/whatif_cost_sensitivity.py /tmp/fid          # ~1 min
    .venv/bin/python bench/whatif_cost_sensitivity.py /tmp/fid --costs 0 4 8 --cells hol upstream
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path


def cell_errors(fifo: Path, measured: Path, policy: str, costs: list[float]) -> tuple[float, float, list[float]]:
    """(measured gain, noise, predicted gain per cost) of one kept cell, in ms."""
    from otel_kvtrace.load import load_traces
    from otel_kvtrace.whatif.measured import MEASURED, measured_summary
    from otel_kvtrace.whatif.replay import group_runs, replay_run
    from otel_kvtrace.whatif.saves import saves_from_duckdb
    from otel_kvtrace.whatif.task import tasks_from_duckdb

    fifo_loaded = load_traces([fifo])
    saves = saves_from_duckdb(fifo_loaded.con)
    (label, fifo_runs), = group_runs(tasks_from_duckdb(fifo_loaded.con)).items()
    (_, policy_runs), = group_runs(tasks_from_duckdb(load_traces([measured]).con)).items()

    def ttft(runs: dict) -> list[float]:  # type: ignore[type-arg]
        return [measured_summary(ts, run_id=r, cfg_label=label).figures[MEASURED]["ttft_ms_mean"] for r, ts in runs.items()]

    fifo_ttft, policy_ttft = ttft(fifo_runs), ttft(policy_runs)
    gain = statistics.fmean(fifo_ttft) - statistics.fmean(policy_ttft)
    noise = max(statistics.stdev(fifo_ttft), statistics.stdev(policy_ttft))
    predicted = []
    for cost in costs:
        cost_ns = {policy: int(cost * 1000)} if cost else None
        reps = [replay_run(ts, policies=[policy], run_id=r, cfg_label=label, saves=saves, dispatch_ns=cost_ns).summary()
                for r, ts in fifo_runs.items()]
        predicted.append(statistics.fmean(x.figures["fifo"]["ttft_ms_mean"] - x.figures[policy]["ttft_ms_mean"]
                                          for x in reps))
    return gain, noise, predicted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog="Example: bench/whatif_cost_sensitivity.py /tmp/fid --costs 0 4 8 12")
    ap.add_argument("kept", type=Path, help="the folder bench/whatif_fidelity.py --keep wrote (interleaved design)")
    ap.add_argument("--costs", type=float, nargs="+", default=[0, 4, 8, 12, 16], help="us per dequeue (default 0 4 8 12 16)")
    ap.add_argument("--cells", nargs="*", help="only these cells (default: every kept one)")
    args = ap.parse_args()
    from otel_kvtrace.whatif.measured import gain_error_pct

    found = sorted(args.kept.glob("*/il-*"))
    if args.cells:
        found = [d for d in found if d.parent.name in args.cells]
    if not found:
        sys.exit(f"error: no kept interleaved cell (<cell>/il-<policy>/) under {args.kept}")
    print(f"{'cell':10} {'policy':11} {'meas':>7} {'noise':>6}  " + "  ".join(f"{c:>6g} us: pred (err %)" for c in args.costs))
    for d in found:
        policy = d.name.removeprefix("il-")
        gain, noise, predicted = cell_errors(d / "fifo" / "traces", d / policy / "traces", policy, args.costs)
        print(f"{d.parent.name:10} {policy:11} {gain:+7.3f} {noise:6.3f}  " + "  ".join(
            f"{p:+8.3f} ({gain_error_pct(p, gain, noise):5.1f})" for p in predicted), flush=True)


if __name__ == "__main__":
    main()
