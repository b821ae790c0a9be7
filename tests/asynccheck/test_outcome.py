"""Outcome metrics (step interval, request latency, throughput) per run and in --compare, with curves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from matplotlib.image import imread

from otel_kvtrace.asynccheck.analysis import check, compare
from otel_kvtrace.cli import main

from .msprof_writer import write_parse_folder, write_request_csv

LATENCIES = list(range(100, 200))  # ms: p50 149.5, p90 189.1, p99 198.01 (linear interpolation)


@pytest.mark.parametrize("older", [False, True], ids=["current-parser", "parser-2025-12"])
def test_request_csv_gives_latency_percentiles_and_throughput(tmp_path: Path, older: bool) -> None:
    folder = write_parse_folder(tmp_path / "out", older=older, raw=False)
    write_request_csv(folder, LATENCIES, older=older, tokens=100)
    out = check([folder]).outcome
    assert out.requests == 100
    assert out.request_latency_p50_ms == pytest.approx(149.5)
    assert out.request_latency_p90_ms == pytest.approx(189.1)
    assert out.request_latency_p99_ms == pytest.approx(198.01)
    # starts every 100 ms, the last (99) ends 199 ms after its start: 9.9 s + 0.199 s
    assert out.output_tokens_per_s == pytest.approx(100 * 100 / 10.099)
    # the writer's steps are 10 ms apart (device start to device start); step 0 is a prefill
    assert out.step_interval_p50_ms == pytest.approx(10.0, abs=0.01)
    assert (out.step_intervals, out.decode_steps_only) == (10, True)


def test_compare_shows_outcome_and_writes_curves(tmp_path: Path) -> None:
    base = write_parse_folder(tmp_path / "base", raw=False)
    write_request_csv(base, [300] * 10)
    tuned = write_parse_folder(tmp_path / "tuned", raw=False)
    write_request_csv(tuned, LATENCIES)
    results = compare({"baseline": [base], "+async": [tuned]})
    assert [r.outcome.request_latency_p90_ms for r in results] == pytest.approx([300.0, 189.1])
    html_path, png_dir = tmp_path / "a.html", tmp_path / "png"
    label = "<b>x</b>"
    result = CliRunner().invoke(main, ["async", "check", "--compare", f"{label}={base}", "--compare", f"+async={tuned}",
                                       "--png-dir", str(png_dir), "--html", str(html_path)], terminal_width=80)
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "latency p90 300.0 ms" in text and "latency p90 189.1 ms" in text
    pngs = sorted(p.name for p in png_dir.iterdir())
    assert pngs == ["batch_size.png", "overlap_timeline.png", "request_latency.png", "step_interval.png"]
    assert all(imread(png_dir / p).shape[0] > 100 for p in pngs)
    page = html_path.read_text()
    assert "&lt;b&gt;x&lt;/b&gt;" in page and label not in page
    assert page.count("data:image/png;base64,") == 4


def test_bad_request_rows_are_named_skips(tmp_path: Path) -> None:
    path = write_request_csv(tmp_path, [100, 200, 300])
    lines = path.read_text().splitlines()
    lines[2] = lines[2].replace(",200,", ",-5,")
    path.write_text("\n".join(lines) + "\n")
    from otel_kvtrace.asynccheck.importers import import_paths

    result = import_paths([path], "r")
    assert len(result.requests) == 2
    assert [(i.line, "absurd" in i.reason) for i in result.issues] == [(3, True)]
    json.dumps([r.rid for r in result.requests])


@pytest.mark.parametrize("files", [["chrome_tracing.json"], ["profiler.db"], ["raw"]])
def test_batch_size_per_step_comes_from_the_schedule_spans(tmp_path: Path, files: list[str]) -> None:
    from otel_kvtrace.asynccheck.tables import connect, load_run

    folder = write_parse_folder(tmp_path / "out")
    con = connect()
    load_run(con, [folder / f for f in files], "r")
    assert con.execute("SELECT count(*), min(batch_size), max(batch_size) FROM async_steps").fetchone() == (12, 4, 4)
    types = con.execute("SELECT batch_type, count(*) FROM async_steps GROUP BY ALL ORDER BY 1").fetchall()
    assert types == [("Decode", 11), ("Prefill", 1)]


@pytest.mark.browser
def test_html_page_in_chromium_shows_every_run_and_decodes_every_curve(tmp_path: Path) -> None:
    from browser import chromium_page

    base = write_parse_folder(tmp_path / "base", raw=False)
    write_request_csv(base, [300] * 10)
    html_path = tmp_path / "a.html"
    result = CliRunner().invoke(main, ["async", "check", "--compare", f"<i>base</i>={base}", "--html", str(html_path),
                                       "--json", str(tmp_path / "a.json")])
    assert result.exit_code == 0, result.output
    doc = json.loads((tmp_path / "a.json").read_text())
    with chromium_page() as (page, log):
        page.goto(html_path.as_uri(), wait_until="load")
        rows = page.eval_on_selector_all("table tr", "rows => rows.slice(1).map(r => [...r.cells].map(c => c.innerText))")
        widths = page.eval_on_selector_all("img", "imgs => imgs.map(i => i.complete ? i.naturalWidth : 0)")
    assert log.errors == []
    assert all(url.startswith(("file://", "data:")) for url in log.requests), log.requests
    assert [(r[0], r[1]) for r in rows] == [(d["run"], d["verdict"]) for d in doc]  # the label shown as text
    assert rows[0][6] == "300.00"  # request latency p90
    assert len(widths) == 4 and all(w > 0 for w in widths)
