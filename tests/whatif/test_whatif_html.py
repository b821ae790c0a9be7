"""The HTML verdict page in headless Chromium: written by ``kvtrace whatif --html`` (real-clock demo traces)
and ``kvtrace sweep --report --html`` (virtual-clock quick sweep), it loads without console errors or
network requests, shows every configuration's verdict and FIFO error as in the JSON, and every inlined
chart decodes. Text from the data is escaped."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from browser import chromium_page
from otel_kvtrace.cli import main
from otel_kvtrace.demo import run_demo
from otel_kvtrace.whatif.render import VerdictReport
from otel_kvtrace.whatif.render_html import render_html


pytestmark = pytest.mark.browser

_DECODED_WIDTHS = """imgs => Promise.all(imgs.map(async img => {
  try { await img.decode(); } catch (e) { return 0; }
  const c = document.createElement("canvas");
  c.width = img.naturalWidth; c.height = img.naturalHeight;
  const ctx = c.getContext("2d");
  ctx.drawImage(img, 0, 0);
  const last = ctx.getImageData(c.width - 1, c.height - 1, 1, 1).data;
  return last[3] === 255 ? img.naturalWidth : 0;
}))"""


@dataclass(slots=True)
class LoadedPage:
    """What the browser saw: console errors, requested URLs, summary rows and chart widths."""

    errors: list[str]
    requests: list[str]
    rows: list[list[str]]
    chart_widths: list[int]
    text: str


def open_page(path: Path, screenshot: Path | None = None) -> LoadedPage:
    with chromium_page() as (page, log):
        page.goto(path.as_uri(), wait_until="load")
        rows = page.eval_on_selector_all(
            "table.summary tr", "rows => rows.slice(1).map(r => [...r.cells].map(c => c.innerText))")
        # naturalWidth is 0 for an image that did not load; a truncated PNG has a width (from its header)
        # but no pixels at the bottom: matplotlib's charts are opaque, so the last pixel must be too
        widths = page.eval_on_selector_all("img.chart", _DECODED_WIDTHS)
        text = page.inner_text("body")
        if screenshot is not None:
            page.screenshot(path=str(screenshot), full_page=True)
    return LoadedPage(log.errors, log.requests, rows, widths, text)


def assert_page_matches_json(page: LoadedPage, doc: dict) -> None:  # type: ignore[type-arg]
    assert page.errors == []
    assert all(url.startswith(("file://", "data:")) for url in page.requests), page.requests
    assert len(page.chart_widths) >= 2  # TTFT and gain charts (+ per-layer when layers were replayed)
    assert all(w > 0 for w in page.chart_widths), page.chart_widths
    assert len(page.rows) == len(doc["configurations"])
    by_label = {row[0]: row for row in page.rows}
    for cfg in doc["configurations"]:
        (row,) = [r for label, r in by_label.items() if label.startswith(cfg["cfg_label"])]
        assert row[-2] == cfg["verdict"]
        assert row[-1] == cfg["reason"]
        assert row[2].startswith(f"{cfg['fifo_median_error_pct']:.2f} (")
        assert row[3] == ", ".join(str(n) for n in cfg["hol_events"])
        # the per-configuration section repeats the verdict with its reason
        assert f"Verdict: {cfg['verdict']}: {cfg['reason']}." in page.text
    assert f"Reproduce: {doc['reproduce']}" in page.text


@pytest.fixture(scope="module")
def demo_traces(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's HOL and FIFO-optimal scenarios on the real clock, three seeds (as test_whatif_recorded)."""
    out = tmp_path_factory.mktemp("demo")
    for seed in range(3):
        run_demo("both", out=out, steps=4, seed=seed)
    return out / "traces"


def test_whatif_html_page_shows_each_verdict_and_its_charts(demo_traces: Path, tmp_path: Path) -> None:
    page_path = tmp_path / "out" / "verdict.html"
    result = CliRunner().invoke(main, ["whatif", str(demo_traces), "--html", str(page_path),
                                       "--json", str(tmp_path / "v.json")])
    assert result.exit_code == 0, result.output
    doc = json.loads((tmp_path / "v.json").read_text())
    assert len(doc["configurations"]) == 2
    assert "--html" in doc["reproduce"]  # the reproduction command recreates the page too
    assert not list(tmp_path.glob("*.png"))  # no --png-dir: charts drawn in a temporary folder and inlined
    page = open_page(page_path, screenshot=tmp_path / "whatif_html.png")
    assert_page_matches_json(page, doc)
    for cfg in doc["configurations"]:
        for policy, metrics in cfg["policies"].items():  # consumer wait and TTFT with spread, per policy
            ttft = metrics["ttft_ms_mean"]
            assert f"{ttft['mean']:.3f} ({ttft['min']:.3f}–{ttft['max']:.3f})" in page.text, policy


def test_sweep_report_html_page_shows_each_cell(tmp_path: Path) -> None:
    out = tmp_path / "sw"
    page_path = out / "verdict.html"
    result = CliRunner().invoke(main, ["sweep", "--quick", "--out", str(out), "--report", "--html", str(page_path)])
    assert result.exit_code == 0, result.output
    assert str(page_path) in result.output
    doc = json.loads((out / "verdict.json").read_text())
    assert {c["verdict"] for c in doc["configurations"]} == {"keep FIFO", "switch to ready_queue"}
    page = open_page(page_path, screenshot=tmp_path / "sweep_html.png")
    assert_page_matches_json(page, doc)
    assert len(page.chart_widths) == len(list(out.glob("whatif_*.png")))


def test_sweep_html_without_report_names_the_option(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["sweep", "--quick", "--out", str(tmp_path), "--html", str(tmp_path / "v.html")])
    assert result.exit_code == 2
    assert "--html" in result.output and "--report" in result.output


def test_text_from_the_data_is_escaped(tmp_path: Path) -> None:
    out = tmp_path / "sw"
    assert CliRunner().invoke(main, ["sweep", "--quick", "--out", str(out), "--report"]).exit_code == 0
    doc = json.loads((out / "verdict.json").read_text())
    from otel_kvtrace.whatif.sweep import run_sweep

    swept = run_sweep(out, quick=True)  # resumed from the cells just written
    hostile = "<img src=x onerror=alert(1)>&<b>bold</b>"
    verdicts = [replace(v, cfg_label=hostile + v.cfg_label, reason=v.reason + " <script>alert(2)</script>")
                for v in swept.verdicts]
    report = VerdictReport(doc["title"] + " <i>x</i>", doc["reproduce"] + " '<&>'", verdicts, notes=["a < b"])
    page_path = tmp_path / "hostile.html"
    page_path.write_text(render_html(report), encoding="utf-8")
    page = open_page(page_path)
    assert page.errors == []  # no alert dialog, no broken image request
    assert all(url.startswith("file://") for url in page.requests), page.requests
    assert hostile in page.text and "<script>alert(2)</script>" in page.text and "'<&>'" in page.text
    assert [row[0].startswith(hostile) for row in page.rows] == [True] * len(verdicts)
