"""The HTML report in headless Chromium: the timeline renders without console errors, a click on a task
shows its stages and dependency times, and zoom changes the visible range."""

from __future__ import annotations

from pathlib import Path

import pytest

from browser import chromium_page
from otel_kvtrace.report import build_report, write_html

pytestmark = pytest.mark.browser


def test_timeline_renders_and_click_shows_stages(synthetic_trace_dir: Path, tmp_path: Path) -> None:
    report = build_report([synthetic_trace_dir], timeline_tasks=300)
    page_path = write_html(report, tmp_path / "report.html")
    with chromium_page() as (page, log):
        page.goto(page_path.as_uri())
        page.wait_for_selector("#timeline rect.stage")
        bars = page.locator("#timeline rect.stage")
        assert bars.count() > 50
        assert page.locator("#timeline rect.hol").count() > 0  # HOL shaded in the initial view

        # Click the head of the longest HOL interval: its stages, dependencies and HOL role show up.
        longest = max(report.timeline["hol"], key=lambda h: h["end"] - h["start"])
        task = next(t for t in report.timeline["tasks"] if t["cid"] == longest["head"])
        widest = max(task["stages"], key=lambda s: s[2] - s[1])[0]  # a zero-width bar can hide under another
        page.locator(f'#timeline rect.stage[data-cid="{longest["head"]}"][data-stage="{widest}"]').click()
        details = page.locator("#details")
        stage_rows = page.locator("#detail-stages tr")
        assert stage_rows.count() == len(task["stages"]) + 1
        text = details.inner_text()
        for name, _start, _end in task["stages"]:
            assert name in text
        for dep in task["deps"]:
            assert dep in text
        assert "blocked head" in text and longest["evidence"] in text
        evidence_bars = page.locator("#timeline rect.evidence")
        assert evidence_bars.count() > 0
        assert {evidence_bars.nth(i).get_attribute("data-cid") for i in range(evidence_bars.count())} <= {
            h["evidence"] for h in report.timeline["hol"] if h["head"] == longest["head"]}

        before = page.evaluate("window.kvtraceTimeline.view()")
        page.click("#zoom-in")
        after = page.evaluate("window.kvtraceTimeline.view()")
        assert after[1] - after[0] < before[1] - before[0]
        page.screenshot(path=str(tmp_path / "timeline.png"), full_page=False)
    assert log.errors == []
    assert all(url.startswith(("file://", "data:")) for url in log.requests), log.requests
