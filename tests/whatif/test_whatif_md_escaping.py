"""`whatif --md`: every value a trace sets (labels, run ids, paths) is literal text in the Markdown."""

from __future__ import annotations

import sys
from pathlib import Path

from markdown_it import MarkdownIt

from otel_kvtrace.whatif.api import whatif

from synthetic_traces import QueueSpec, simulate_queue, write_otlp_json  # bench/, on sys.path via tests/conftest.py

PAYLOAD = '<script>alert(1)</script><img src=x onerror=alert(2)>|x*y*_z_ [l](javascript:alert(3)) `c`'


def test_labels_and_run_ids_from_a_trace_render_as_text(tmp_path: Path) -> None:
    spec = QueueSpec(run_id="run|" + PAYLOAD, cfg_label="cfg " + PAYLOAD)
    trace = write_otlp_json(tmp_path / "t.jsonl", [(spec, simulate_queue(spec, 48, seed=2, hol_probability=0.3))])
    md_path = tmp_path / "verdict.md"
    whatif([trace], md_path=md_path)
    text = md_path.read_text()
    assert "<script>" not in text and "<img" not in text
    rendered = MarkdownIt("commonmark", {"html": True}).enable("table").render(text)
    assert "<script" not in rendered and "<img" not in rendered and 'href="javascript' not in rendered
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in rendered  # shown, as text
    header_cells = None
    for line in text.splitlines():  # every summary row keeps its nine cells
        if line.startswith("| configuration |"):
            header_cells = line.count(" | ")
        elif header_cells is not None and line.startswith("| cfg "):
            assert line.replace("\\|", "").count(" | ") == header_cells, line
            break
    else:
        raise AssertionError("no summary row")
