"""How the what-if's error on kept fidelity traces moves with a per-dequeue cost of the live policy.

``bench/whatif_fidelity.py --keep DIR`` keeps each cell's FIFO and policy runs. This prints, per kept
cell, the prediction as ``kvtrace whatif`` makes it (``derived``: the cost per dequeue sized from the FIFO
recording, ``otel_kvtrace/whatif/decision.py``; its value per queue in us), then replays the cell's FIFO
runs again with the policy charged ``X`` us per dequeue instead (the replay's ``dispatch_ns``: on the served
task's start, and through ``gil.py`` on the forward's wake-up lag behind the recv thread) for each
``--costs`` value, with the predicted gain and its error against the measured gain of the kept policy runs
(``gain_error_pct``, the bench's ``err %``). The swept columns answer whether another cost per dequeue
would explain a cell's miss (docs/whatif.md); they are not predictions (the cost is swept, not derived).

``--pre-sync-extra US...`` (an oracle, for reading only): the derived prediction again with, in place of
what the build model (``gil.py``, third part) adds before each policy-replayed save's NPU sync, that many
us per save position in a step (FIFO untouched; only where the build model is fitted, as on the replica
cells), e.g. the live policy's longer pre-sync work read off the kept runs' send spans: how much of a
cell's miss it would explain if the replay knew it.

Usage::

    .venv/bin/python bench/whatif_fidelity.py --keep /tmp/fid          # once (~15 min)
    .venv/bin/python bench/whatif_cost_sensitivity.py /tmp/fid          # ~1 min
    .venv/bin/python bench/whatif_cost_sensitivity.py /tmp/fid --costs 0 4 8 --cells hol upstream
    .venv/bin/python bench/whatif_cost_sensitivity.py /tmp/fid --cells hol --pre-sync-extra 0 0 0 0 33 32 14 0
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path
from unittest import mock


def cell_errors(fifo: Path, measured: Path, policy: str, costs: list[float]
                ) -> tuple[float, float, float, float, list[float]]:
    """(measured gain, noise, derived prediction, derived cost per dequeue in us, predicted gain per cost)
    of one kept cell, gains in ms: the measured side, the derived prediction and its cost are ``kvtrace
    whatif --measured``'s own (:func:`whatif`; the cost 0 unless the policy probes the head), the others
    the same FIFO runs replayed again with the cost (``replay_run(dispatch_ns=...)``, as its ``cal``
    column is)."""
    from otel_kvtrace.load import load_traces
    from otel_kvtrace.whatif.api import whatif
    from otel_kvtrace.whatif.policy import get_policy
    from otel_kvtrace.whatif.replay import group_runs, replay_run
    from otel_kvtrace.whatif.saves import saves_from_duckdb
    from otel_kvtrace.whatif.task import tasks_from_duckdb

    (verdict,) = whatif([fifo], measured=[measured], policies=[policy]).verdicts
    (c,) = verdict.extra["measured"]
    derived = verdict.extra["decision_cost_us"] if get_policy(policy).probes_head else 0.0
    loaded = load_traces([fifo])
    saves = saves_from_duckdb(loaded.con)
    (label, fifo_runs), = group_runs(tasks_from_duckdb(loaded.con)).items()
    predicted = []
    for cost in costs:
        reps = [replay_run(ts, policies=[policy], run_id=r, cfg_label=label, saves=saves,
                           dispatch_ns={policy: int(cost * 1000)}).summary() for r, ts in fifo_runs.items()]
        predicted.append(statistics.fmean(x.figures["fifo"]["ttft_ms_mean"] - x.figures[policy]["ttft_ms_mean"]
                                          for x in reps))
    return c["measured_gain_ms"], c["noise_ms"], c["predicted_gain_ms"], derived, predicted


@contextlib.contextmanager
def pre_sync_extra(extra_us: list[float]) -> Iterator[None]:
    """Every policy replay's saves get ``extra_us[k]`` at save position ``k`` before their NPU sync, in place
    of the build model's waits (the oracle of ``--pre-sync-extra``)."""
    from otel_kvtrace.whatif import gil

    extra = [int(x * 1000) for x in extra_us]

    def oracle(rep, fifo_waits, policy_waits):  # noqa: ANN001, ANN202 (gil.pre_extra's signature)
        return [[extra[k] if k < len(extra) else 0 for k in range(len(saves))] for saves in rep.arrays.send or []]

    with mock.patch.object(gil, "pre_extra", oracle):
        yield


def oracle_prediction(fifo: Path, measured: Path, policy: str, extra_us: list[float]) -> float:
    """The derived prediction (ms) with ``--pre-sync-extra`` applied."""
    from otel_kvtrace.whatif.api import whatif

    with pre_sync_extra(extra_us):
        (verdict,) = whatif([fifo], measured=[measured], policies=[policy]).verdicts
    return verdict.extra["measured"][0]["predicted_gain_ms"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog="Example: bench/whatif_cost_sensitivity.py /tmp/fid --costs 0 4 8 12")
    ap.add_argument("kept", type=Path, help="the folder bench/whatif_fidelity.py --keep wrote (interleaved design)")
    ap.add_argument("--costs", type=float, nargs="+", default=[0, 4, 8, 12, 16], help="us per dequeue (default 0 4 8 12 16)")
    ap.add_argument("--cells", nargs="*", help="only these cells (default: every kept one)")
    ap.add_argument("--pre-sync-extra", type=float, nargs="+", metavar="US",
                    help="oracle: us before each policy-replayed save's NPU sync, per save position in a step, in "
                         "place of the build model's")
    args = ap.parse_args()
    from otel_kvtrace.whatif.measured import gain_error_pct

    found = sorted(args.kept.glob("*/il-*"))
    if args.cells:
        found = [d for d in found if d.parent.name in args.cells]
    if not found:
        sys.exit(f"error: no kept interleaved cell (<cell>/il-<policy>/) under {args.kept}")
    print(f"{'cell':10} {'policy':11} {'meas':>7} {'noise':>6}  {'derived us':>11}: pred (err %)  "
          + "  ".join(f"{c:>6g} us: pred (err %)" for c in args.costs))
    for d in found:
        policy = d.name.removeprefix("il-")
        gain, noise, pred, derived, predicted = cell_errors(d / "fifo" / "traces", d / policy / "traces", policy,
                                                            args.costs)
        oracle = ""
        if args.pre_sync_extra:
            o = oracle_prediction(d / "fifo" / "traces", d / policy / "traces", policy, args.pre_sync_extra)
            oracle = f"  pre-sync extra: {o:+8.3f} ({gain_error_pct(o, gain, noise):5.1f})"
        print(f"{d.parent.name:10} {policy:11} {gain:+7.3f} {noise:6.3f}  {derived:11.1f}: {pred:+8.3f} "
              f"({gain_error_pct(pred, gain, noise):5.1f})  " + "  ".join(
            f"{p:+8.3f} ({gain_error_pct(p, gain, noise):5.1f})" for p in predicted) + oracle, flush=True)


if __name__ == "__main__":
    main()
