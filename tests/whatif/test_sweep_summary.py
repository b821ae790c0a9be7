"""The sweep's summary first: factor effects on HOL, quick cells labelled, switches never silently final."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from click.testing import CliRunner

from otel_kvtrace.cli import main
from otel_kvtrace.whatif.sweep import _qualify, run_sweep, sweep_summary


def test_without_report_the_sweep_prints_its_summary_and_verdict(tmp_path: Path) -> None:
    out = CliRunner().invoke(main, ["sweep", "--quick", "--out", str(tmp_path)])
    assert out.exit_code == 0, out.output
    text = " ".join(out.output.split())  # the lines are wrapped to the terminal width
    assert "Summary (quick matrix, virtual clock, 4 steps x 3 seeds per cell): 1 of 2 cells have HOL" in text
    # the quick matrix differs only in the independent layers: the factor analysis names that factor
    assert "What produces HOL: HOL time (ms per run): independent_layers ([0] -> [0, 4]) raises it" in text
    assert "Verdict: 1 of 2 cells are switch candidates" in text and "not final" in text


def test_switch_verdicts_say_what_they_rest_on_and_the_report_starts_with_the_summary(tmp_path: Path) -> None:
    result = run_sweep(tmp_path, quick=True)
    switch = [v for v in result.verdicts if v.verdict != "keep FIFO"]
    assert switch and all("quick matrix, virtual clock, 4 steps x 3 seeds" in v.reason and "not final" in v.reason
                          for v in switch)
    keep = [v for v in result.verdicts if v.verdict == "keep FIFO"]
    assert keep and all("not final" not in v.reason for v in keep)
    summary = sweep_summary(result)
    effect = {e["factor"]: e for e in summary["factor_effects"]}["independent_layers"]
    assert effect["real"] and effect["effect"] > effect["noise"] > 0
    res = CliRunner().invoke(main, ["sweep", "--quick", "--out", str(tmp_path), "--report"])
    assert res.exit_code == 0
    md = (tmp_path / "verdict.md").read_text()
    assert md.index("## Summary") < md.index("Reproduce:")
    assert json.loads((tmp_path / "verdict.json").read_text())["summary"]["switch_candidates"] == 1


def test_a_disagreeing_real_clock_confirmation_is_said_next_to_the_cell(tmp_path: Path) -> None:
    result = run_sweep(tmp_path, quick=True)
    (cand,) = [v for v in result.verdicts if v.verdict != "keep FIFO"]
    # the real clock's noise floor is a recorded run's: there the same gain can fall below noise
    result.confirmation = replace(cand, verdict="keep FIFO", reason="HOL present but gain below noise",
                                  extra={**cand.extra, "clock": "real"})
    cand.reason = cand.reason.split(" [")[0]
    _qualify(result)
    assert "[real-clock confirmation disagrees: keep FIFO: HOL present but gain below noise]" in cand.reason
    assert "real-clock confirmation of" in sweep_summary(result)["verdict"]
