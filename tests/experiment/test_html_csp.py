"""The experiment and async-check pages use the project's one CSP (report/html_safety.csp_meta): no
'unsafe-inline', no ``style=`` attributes, each inline ``<style>`` allowed by its hash."""

from __future__ import annotations

import base64
import hashlib
from html.parser import HTMLParser
from pathlib import Path

from otel_kvtrace.asynccheck.curves import write_html
from otel_kvtrace.experiment.render import render_html

from .test_report_render import _cell, _doc


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.csp: list[str] = []
        self.style_attrs: list[str] = []
        self.styles: list[str] = []
        self._in_style = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "meta" and (a.get("http-equiv") or "").lower() == "content-security-policy":
            self.csp.append(a.get("content") or "")
        if "style" in a:
            self.style_attrs.append(f"<{tag} style={a['style']}>")
        self._in_style = tag == "style"

    def handle_data(self, data: str) -> None:
        if self._in_style:
            self.styles.append(data)

    def handle_endtag(self, tag: str) -> None:
        self._in_style = False


def _check(page: str) -> None:
    parsed = _Page()
    parsed.feed(page)
    assert len(parsed.csp) == 1 and "unsafe-inline" not in parsed.csp[0], parsed.csp
    assert parsed.style_attrs == []
    for style in parsed.styles:
        digest = base64.b64encode(hashlib.sha256(style.encode()).digest()).decode()
        assert f"'sha256-{digest}'" in parsed.csp[0]


def test_experiment_page_with_a_heatmap_needs_no_inline_styles() -> None:
    doc = _doc("tail", "reason")
    doc["factors"] = ["num_shared_buffers", "prefetch_layers"]
    heat = [_cell(b, p, b * 10 + p) for b in (2, 16) for p in (2, 4)]
    base = doc["cells"][0]
    doc["cells"] += [{**base, "config": c["config"], "hol": {**base["hol"], **c["hol"]}, "cell_id": f"c{i}"}
                     for i, c in enumerate(heat)]
    page = render_html(doc)
    assert 'class="hm hm10"' in page and 'class="hm hm' in page  # the heatmap is there, shaded by class
    _check(page)


def test_async_check_page_uses_the_shared_csp(tmp_path: Path) -> None:
    _check(write_html({}, [], tmp_path / "a.html").read_text())
