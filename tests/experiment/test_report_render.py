"""The report's views: level order, escaping of run values (log tails), effect rows."""

from __future__ import annotations

from otel_kvtrace.experiment.render import heatmap


def _cell(b: int, p: int, hol: float) -> dict:
    return {"config": {"num_shared_buffers": b, "prefetch_layers": p}, "hol": {"total_ms": hol},
            "ttft_ms": {"p50": 1.0}}


def test_heatmap_levels_sort_by_value_not_text() -> None:
    doc = {"factors": ["num_shared_buffers", "prefetch_layers"],
           "cells": [_cell(b, p, b * 10 + (p or 0)) for b in (16, 2) for p in (None, 4)]}
    rf, cf, rows, cols, means = heatmap(doc)
    assert rows == ["2", "16"] and cols == ["4", "default"]
    assert means[("16", "4")] == 164


def _doc(log_tail: str, reason: str) -> dict:
    ttft = {"p50": 1.0, "p95": 2.0, "p99": 3.0}
    waits = {k: {"p50": None, "p95": None, "p99": None} for k in ("queue_wait_ms", "dep_wait_ms", "hol_event_ms")}
    cell = {"cell_id": "P4", "config": {"prefetch_layers": 4}, "command": "kvtrace serve-replica `x`",
            "runs": [{"run": 1, "status": "failed", "reason": reason, "log_tail": log_tail, "traces": "/t"}],
            "runs_ok": 0, "ttft_ms": ttft, "ttft_p50_noise_ms": None, "throughput_tok_s": None,
            "throughput_noise_tok_s": None, "hol": {"events": None, "total_ms": None, "total_ms_noise": None},
            "queue_wait_ms": None, "consumer_wait_ms": None, "peak_host_rss_mb": None, "peak_inflight_tasks": None,
            "whatif": {"verdict": "", "reason": "no finished run"}, "wait_percentiles": waits}
    return {"title": "t", "verdict": "v", "verdict_details": [], "environment": {}, "factors": ["prefetch_layers"],
            "cells": [cell], "factor_effects": []}


def test_log_tail_and_reason_cannot_break_out_of_the_markdown() -> None:
    from markdown_it import MarkdownIt

    from otel_kvtrace.experiment.render import render_markdown

    tail = "starting\n```\n# not a heading\n[click](javascript:alert(1))\n<script>x</script>\n````"
    md = render_markdown(_doc(tail, "bad [link](http://evil) <b>x</b>"))
    html = MarkdownIt("commonmark").render(md)
    assert "<h1>not a heading</h1>" not in html and "<script>" not in html and "<b>x</b>" not in html
    assert 'href="javascript' not in html and 'href="http://evil"' not in html
    assert "# not a heading" in html  # shown verbatim inside the code block
