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
