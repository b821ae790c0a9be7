"""The coverage sweep on the virtual clock: HOL and an honest switch where the layout causes it, "keep FIFO"
for uniform layouts, resumable storage, and the CLI/report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from otel_kvtrace.cli import main
from otel_kvtrace.whatif.sweep import SweepError, SweepMatrix, run_sweep

MATRIX = SweepMatrix(paths=("gva",), prefetch=(4,), buffers=(2,), reuse=(True,), independent=((0,), (0, 4)),
                     requests=(2,), stresses=("none", "slow_save", "slow_slot"), repeats=3)


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    out = tmp_path_factory.mktemp("sweep")
    return run_sweep(out, matrix=MATRIX)


def _cell(result, indep: tuple[int, ...], stress: str):  # type: ignore[no-untyped-def]
    (v,) = [v for v in result.verdicts
            if tuple(v.config["independent_layers"]) == indep and v.config["stress"] == stress]
    return v


def test_every_cell_has_three_seeded_runs_and_a_validated_fifo_replay(swept) -> None:  # type: ignore[no-untyped-def]
    assert len(swept.verdicts) == 6
    for v in swept.verdicts:
        assert len(v.run_ids) == 3 and len(set(v.run_ids)) == 3
        assert v.validated and v.fifo_median_error_pct <= 5.0


def test_independent_layers_not_a_prefix_show_stable_hol_and_an_honest_switch(swept) -> None:  # type: ignore[no-untyped-def]
    for stress in ("slow_save", "slow_slot"):
        v = _cell(swept, (0, 4), stress)
        assert all(n > 0 for n in v.hol_events), stress
        assert v.verdict == "switch to ready_queue", (stress, v.reason)
        gain = v.gains["ready_queue"]
        assert gain["lower_bound_ms"] > v.noise_ms > 0
        # honest: the TTFT gained per step never exceeds the head-of-line time it removes
        steps = v.config["steps"]
        for g, hol in zip(gain["ttft_gain_ms"]["per_run"], v.hol_ms, strict=True):
            assert 0 < g * steps <= hol


def test_uniform_layout_keeps_fifo_for_lack_of_hol(swept) -> None:  # type: ignore[no-untyped-def]
    v = _cell(swept, (0,), "none")
    assert v.verdict == "keep FIFO"
    assert v.reason.startswith("no stable HOL")
    assert v.hol_events == [0, 0, 0]
    prefix_slow_save = _cell(swept, (0,), "slow_save")
    assert prefix_slow_save.verdict == "keep FIFO"


def test_finished_cells_are_not_rerun(tmp_path: Path) -> None:
    matrix = SweepMatrix.quick()
    first = run_sweep(tmp_path, matrix=matrix)
    assert (first.ran, first.resumed) == (len(first.cells) * 3, 0)
    again = run_sweep(tmp_path, matrix=matrix)
    assert (again.ran, again.resumed) == (0, len(first.cells) * 3)
    assert [v.verdict for v in again.verdicts] == [v.verdict for v in first.verdicts]
    next(tmp_path.glob("cells/*/seed1.json")).unlink()
    partial = run_sweep(tmp_path, matrix=matrix)
    assert (partial.ran, partial.resumed) == (1, len(first.cells) * 3 - 1)


def test_default_matrix_covers_the_axes_and_collapses_irrelevant_ones() -> None:
    cells = SweepMatrix().cells()
    assert {c.path for c in cells} == {"gva", "key"}
    assert {c.prefetch_layers for c in cells} == {None, 2, 4}
    assert {c.num_shared_buffers for c in cells if c.path == "gva"} == {None, 2, 4}
    assert {c.buffer_reuse for c in cells if c.path == "gva"} == {True, False}
    assert {c.independent_layers for c in cells} == {(0,), (0, 4)}
    assert {c.requests_per_step for c in cells} == {1, 2, 4}
    key = [c for c in cells if c.path == "key"]
    assert all(c.num_shared_buffers is None and not c.buffer_reuse for c in key)
    assert len(key) == 3 * 3 * 3  # prefetch x requests x stress
    assert SweepMatrix().repeats >= 3
    with pytest.raises(SweepError, match="stress"):
        run_sweep("unused", matrix=SweepMatrix(stresses=("hot",)))


def test_cli_sweep_quick_writes_the_report(tmp_path: Path) -> None:
    out = tmp_path / "sw"
    result = CliRunner().invoke(main, ["sweep", "--quick", "--out", str(out), "--report"])
    assert result.exit_code == 0, result.output
    doc = json.loads((out / "verdict.json").read_text())
    assert doc["reproduce"] == f"kvtrace sweep --out {out} --quick --report"
    for cfg in doc["configurations"]:
        assert "fifo_median_error_pct" in cfg and cfg["verdict"] in ("keep FIFO", "switch to ready_queue",
                                                                     "switch to gate_group")
    md = (out / "verdict.md").read_text()
    assert f"Reproduce: `kvtrace sweep --out {out} --quick --report`" in md
    assert (out / "whatif_ttft.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rerun = CliRunner().invoke(main, ["sweep", "--quick", "--out", str(out)])
    assert "0 run(s) computed" in rerun.output


def test_confirmation_reruns_the_chosen_cell_on_the_real_clock(tmp_path: Path) -> None:
    result = run_sweep(tmp_path, quick=True, confirm=True)
    c = result.confirmation
    assert c is not None and c.config["clock"] == "real"
    # the chosen cell is the quick matrix's switch cell (non-prefix independent layers)
    assert tuple(c.config["independent_layers"]) == (0, 4)
    assert len(c.run_ids) == 3
    assert c.validated and c.fifo_median_error_pct <= 5.0
    assert all(n > 0 for n in c.hol_events)
    assert list((tmp_path / "realclock").glob("*/traces/*.jsonl"))
