"""The HTML report in headless Chromium: the timeline renders without console errors, a click on a task
shows its stages and dependency times, and zoom changes the visible range."""

from __future__ import annotations

from pathlib import Path

import pytest

from browser import chromium_page
from otel_kvtrace.report import build_report, render_html, write_html

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


PAYLOAD = "\"'><img src=x onerror=window.__pwned=1><!--<script>"
SCRIPT_PAYLOAD = "</script><script>window.__pwned=2</script>"


def _poison(value: object) -> None:
    """Append the payload to every string attribute value of an OTLP/JSON request, in place."""
    if isinstance(value, dict):
        if isinstance(value.get("stringValue"), str):
            value["stringValue"] += PAYLOAD
        for item in value.values():
            _poison(item)
    elif isinstance(value, list):
        for item in value:
            _poison(item)


@pytest.fixture(scope="module")
def hostile_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A trace whose every string field (resource and span attributes: run id, config label, queue,
    thread, correlation ids, outcome, precision, ...) carries HTML/script payloads."""
    import orjson
    from synthetic_traces import QueueSpec, simulate_queue, write_otlp_json

    out = tmp_path_factory.mktemp("hostile")
    spec = QueueSpec(run_id="run" + PAYLOAD, cfg_label="cfg" + SCRIPT_PAYLOAD, thread_name="t" + PAYLOAD)
    clean = out / "clean.jsonl"
    write_otlp_json(clean, [(spec, simulate_queue(spec, 200, seed=1, hol_probability=0.3))], with_send_tasks=True)
    lines = []
    for line in clean.read_bytes().splitlines():
        request = orjson.loads(line)
        _poison(request)
        lines.append(orjson.dumps(request))
    clean.unlink()
    (out / "hostile.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    return out


def _click_bar(page, cid: str) -> None:  # noqa: ANN001 - playwright Page
    """A real mouse click on the widest stage bar of task ``cid`` (found by attribute value, not by a
    CSS selector the payload's quotes would break)."""
    box = page.evaluate("""cid => {
        const bars = [...document.querySelectorAll('#timeline rect.stage')].filter(r => r.getAttribute('data-cid') === cid);
        const r = bars.reduce((a, b) => (b.getBBox().width > a.getBBox().width ? b : a)).getBoundingClientRect();
        return {x: r.x + r.width / 2, y: r.y + r.height / 2};
    }""", cid)
    page.mouse.click(box["x"], box["y"])


def test_script_payloads_in_every_string_field_run_nothing(hostile_trace: Path, tmp_path: Path) -> None:
    report = build_report([hostile_trace], timeline_tasks=300)
    assert report.timeline["hol"], "the hostile trace must still have HOL events to click"
    page_path = write_html(report, tmp_path / "hostile.html")
    with chromium_page() as (page, log):
        page.goto(page_path.as_uri())
        page.wait_for_selector("#timeline rect.stage", timeout=10_000)
        assert page.locator("#timeline rect.stage").count() > 50  # the timeline still renders
        longest = max(report.timeline["hol"], key=lambda h: h["end"] - h["start"])
        _click_bar(page, longest["head"])
        details = page.locator("#details").inner_text()
        assert longest["head"] in details and longest["evidence"] in details  # shown as text, verbatim
        assert "ok" + PAYLOAD in details
        _click_bar(page, longest["evidence"])
        assert "evidence for " + longest["head"] in page.locator("#details").inner_text()
        body = page.locator("body").inner_text()
        assert "cfg" + SCRIPT_PAYLOAD + PAYLOAD in body  # config label in the tables, verbatim
        assert page.evaluate("window.__pwned") is None
        assert page.evaluate("document.scripts.length") == 2
        assert page.locator("img:not(.plot), svg svg, iframe").count() == 0
        assert page.locator("#hol-summary tr").count() > 1
    assert log.errors == []  # also catches refused scripts: a CSP violation is a console error
    assert all(url.startswith(("file://", "data:")) for url in log.requests), log.requests
    text = page_path.read_text(encoding="utf-8")
    assert "<!--<script>" not in text and SCRIPT_PAYLOAD not in text
    assert "Content-Security-Policy" in text


def test_policy_refuses_markup_that_slipped_in(synthetic_trace_dir: Path, tmp_path: Path) -> None:
    """The second wall: were some value ever to reach the page unescaped, the content security policy
    still runs only the page's own script and style."""
    page = render_html(build_report([synthetic_trace_dir], timeline_tasks=100))
    injected = ('<script>window.__pwned=3</script><img id="inj" src="x" onerror="window.__pwned=4">'
                '<p id="styled" style="color: rgb(255, 0, 0)">x</p>')
    path = tmp_path / "injected.html"
    path.write_text(page.replace("<h2>Timeline</h2>", injected + "<h2>Timeline</h2>"), encoding="utf-8")
    with chromium_page() as (browser_page, log):
        browser_page.goto(path.as_uri())
        browser_page.wait_for_selector("#timeline rect.stage", timeout=10_000)
        assert browser_page.evaluate("window.__pwned") is None
        color = browser_page.evaluate("getComputedStyle(document.getElementById('styled')).color")
        assert color != "rgb(255, 0, 0)"
    refused = [e for e in log.errors if "Content Security Policy" in e]
    assert len(refused) >= 3, log.errors  # script, inline handler, style attribute


def _page_state(page) -> dict:  # noqa: ANN001 - playwright Page
    return page.evaluate("""() => ({
        selected: [...new Set([...document.querySelectorAll('#timeline rect.selected')].map(r => r.getAttribute('data-cid')))],
        evidence: [...new Set([...document.querySelectorAll('#timeline rect.evidence')].map(r => r.getAttribute('data-cid')))],
        arrows: document.querySelectorAll('#timeline line.hol-arrow').length,
        markers: [...document.querySelectorAll('#timeline circle.ready-marker')].map(c => c.getAttribute('class')),
        active: window.kvtraceTimeline.active(), view: window.kvtraceTimeline.view(),
    })""")


def test_hol_row_click_selects_head_and_evidence(synthetic_trace_dir: Path, tmp_path: Path) -> None:
    report = build_report([synthetic_trace_dir], timeline_tasks=300)
    page_path = write_html(report, tmp_path / "report.html")
    hol = sorted(report.timeline["hol"], key=lambda h: h["end"] - h["start"], reverse=True)
    with chromium_page() as (page, log):
        page.goto(page_path.as_uri())
        rows = page.locator("#hol-intervals tr.hol-row")
        assert rows.count() == min(50, len(hol))
        assert rows.nth(0).locator("td").nth(1).inner_text() == hol[0]["blocked_by"] != "unknown"
        assert " ms" in rows.nth(0).locator("td").nth(4).inner_text()  # ms, not epoch ns
        target = hol[3]  # not the interval the page opens on
        rows.nth(3).click()
        state = _page_state(page)
        assert state["active"] == {"head": target["head"], "evidence": target["evidence"]}
        assert state["selected"] == [target["head"]] and state["evidence"] == [target["evidence"]]
        assert state["arrows"] == 1 and sorted(state["markers"]) == ["ready-marker evidence-ready",
                                                                     "ready-marker head-ready"]
        assert state["view"][0] <= target["start"] and target["end"] <= state["view"][1]
        assert target["head"] in page.locator("#details").inner_text()
    assert log.errors == []


def test_every_run_has_its_own_axis_from_zero(synthetic_trace_dir: Path, tmp_path: Path) -> None:
    report = build_report([synthetic_trace_dir], timeline_tasks=300)
    runs = report.timeline["runs"]
    assert len(runs) == 2 and len({r["t0_ns"] for r in runs}) == 2
    for index in range(len(runs)):
        queues = [q for q, run in enumerate(report.timeline["queue_runs"]) if run == index]
        assert min(t["enqueue"] for t in report.timeline["tasks"] if t["queue"] in queues) == 0
    page_path = write_html(report, tmp_path / "report.html")
    with chromium_page() as (page, log):
        page.goto(page_path.as_uri())
        for index, run in enumerate(runs):
            page.select_option("#run-select", str(index))
            labels = page.locator("#timeline text.queue-label").all_text_contents()
            assert labels and all(run["cfg"] in label for label in labels)  # only that run's queues
            view = page.evaluate("window.kvtraceTimeline.view()")
            assert view[0] == 0
            ticks = page.locator("#timeline text.tick").all_text_contents()
            assert ticks[0] == "0.000 ms" and all(t.endswith(" ms") for t in ticks)
    assert log.errors == []


def test_search_finds_a_correlation_id(synthetic_trace_dir: Path, tmp_path: Path) -> None:
    report = build_report([synthetic_trace_dir], timeline_tasks=300)
    page_path = write_html(report, tmp_path / "report.html")
    task = report.timeline["tasks"][-1]  # far from where the page opens
    with chromium_page() as (page, log):
        page.goto(page_path.as_uri())
        page.fill("#search", task["cid"])
        page.press("#search", "Enter")
        assert page.locator("#search-result").inner_text().strip() == "1 of 1 matches"
        assert _page_state(page)["selected"] == [task["cid"]]
        view = page.evaluate("window.kvtraceTimeline.view()")
        assert view[0] <= task["enqueue"] <= view[1]
        assert page.locator("#details b").inner_text() == task["cid"]
        page.fill("#search", "no-such-task")
        page.press("#search", "Enter")
        assert "no task shown matches" in page.locator("#search-result").inner_text()
    assert log.errors == []


def test_jaeger_link_and_bad_url(synthetic_trace_dir: Path, tmp_path: Path) -> None:
    report = build_report([synthetic_trace_dir], timeline_tasks=100)
    page_path = write_html(report, tmp_path / "report.html", jaeger_url="http://localhost:16686/")
    task = report.timeline["tasks"][0]
    with chromium_page() as (page, log):
        page.goto(page_path.as_uri())
        page.evaluate(f"window.kvtraceTimeline.showDetails({task['cid']!r})")
        href = page.locator("#jaeger-link").get_attribute("href")
    assert href == f"http://localhost:16686/trace/{task['trace_id']}"
    assert log.errors == []
    with pytest.raises(ValueError, match="http"):
        render_html(report, jaeger_url="javascript:alert(1)")


def test_axis_and_queue_name_stay_on_top_while_rows_scroll(synthetic_trace_dir: Path, tmp_path: Path) -> None:
    report = build_report([synthetic_trace_dir], timeline_tasks=300)
    page_path = write_html(report, tmp_path / "report.html")
    with chromium_page(height=800) as (page, log):
        page.goto(page_path.as_uri())
        page.evaluate("document.getElementById('timeline-wrap').scrollTop = 0")
        page.evaluate("document.getElementById('timeline-wrap').dispatchEvent(new Event('scroll'))")
        page.evaluate("document.getElementById('timeline-wrap').scrollTop = 400")
        page.wait_for_function("document.querySelector('#timeline rect.axis-band').getAttribute('y') === '400'")
        band = page.evaluate("""() => {
            const wrap = document.getElementById('timeline-wrap'), band = document.querySelector('#timeline rect.axis-band');
            const wr = wrap.getBoundingClientRect(), br = band.getBoundingClientRect();
            const tick = document.querySelector('#timeline text.tick').getBoundingClientRect();
            const q = document.querySelector('#timeline text.sticky-queue');
            return {bandTop: br.top - wr.top, tickTop: tick.top - wr.top, queue: q ? q.textContent : null};
        }""")
    assert abs(band["bandTop"]) <= 2 and 0 <= band["tickTop"] <= 22  # still at the top of the visible rows
    assert band["queue"] and report.timeline["queues"][0].endswith(band["queue"])
    assert log.errors == []
