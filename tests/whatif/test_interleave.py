"""The fidelity bench's interleaved design (``bench/whatif_fidelity.py --design interleaved``): one real
replica run switching the live policy per step, split by step into a FIFO run and a policy run that the
what-if's measured comparison pairs by seed."""

from __future__ import annotations

from pathlib import Path

import pytest
import whatif_fidelity as fid

from otel_kvtrace.load import load_traces
from otel_kvtrace.whatif.api import whatif
from otel_kvtrace.whatif.replay import group_runs
from otel_kvtrace.whatif.task import ReplayTask, tasks_from_duckdb


def test_step_order_is_abba_per_step_and_both_steps_of_a_pair_run_the_same_work() -> None:
    assert fid.step_order(2, 3, "rq") == ["fifo", "rq", "rq", "fifo", "fifo", "rq"]
    assert fid.step_order(1, 2, "rq") == ["rq", "fifo", "fifo", "rq"]
    assert fid.pair_rows(3) == [0, 0, 1, 1, 2, 2]


def _runs(folder: Path) -> dict[str, list[ReplayTask]]:
    (runs,) = group_runs(tasks_from_duckdb(load_traces([folder]).con)).values()
    return runs


def _orders(tasks: list[ReplayTask]) -> dict[int, list[int]]:
    """Per step, the layers in the order the recv thread dequeued them."""
    by: dict[int, list[ReplayTask]] = {}
    for t in tasks:
        by.setdefault(t.step, []).append(t)
    return {s: [t.layer_id for t in sorted(ts, key=lambda t: t.recorded_start_ns or 0)] for s, ts in by.items()}


@pytest.mark.parametrize("aa", [False, True])
def test_an_interleaved_run_splits_into_the_fifo_steps_and_the_policy_steps(tmp_path: Path, aa: bool) -> None:
    dirs = fid.record_interleaved("hol", "ready_queue", 1, 4, tmp_path, {}, aa=aa)
    order = fid.step_order(1, 4, "ready_queue")
    for policy in ("fifo", "ready_queue"):
        runs = _runs(dirs[policy])
        assert list(runs) == [f"il-hol-ready_queue-{policy}-s001"]  # a seed label: paired with the other half
        orders = _orders(runs[f"il-hol-ready_queue-{policy}-s001"])
        assert sorted(orders) == [i for i, p in enumerate(order) if p == policy]  # its own steps, all of them
        for layers in orders.values():
            assert sorted(layers) == list(range(8))
            live = "fifo" if aa else policy
            assert (layers.index(4) < layers.index(3)) is (live == "ready_queue")  # 4 passes 3's slow save
    report = whatif([dirs["fifo"]], measured=[dirs["ready_queue"]], policies=["ready_queue"])
    (cmp,) = [c for v in report.verdicts for c in v.extra.get("measured", [])]
    assert cmp["pairing"] == "seed" and cmp["policy"] == "ready_queue"
