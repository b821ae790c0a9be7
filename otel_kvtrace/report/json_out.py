"""Machine-readable report: the ``--json FILE`` output of ``kvtrace report``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from otel_kvtrace.report.model import Report

INTERVAL_FIELDS = (
    "queue", "head_correlation_id", "head_seq", "evidence_correlation_id", "evidence_seq", "evidence_ready_ns",
    "class", "start_ns", "end_ns", "dur_ns",
)


def report_to_dict(report: Report) -> dict[str, Any]:
    """The report as plain JSON types: ``load``, ``tasks``, ``stages``, ``hol`` (with ``events``,
    ``total_ms``, percentiles and every interval), ``queue_depth``, ``consumer_stall``, ``wait_explained``,
    ``resources`` (``files``, per-field ``summary`` {samples, peak, p50, p95, p99}, ``skipped``; ``{}`` when
    no resource series lie beside the traces)."""
    intervals = [{k: r[k] for k in INTERVAL_FIELDS} for r in report.hol_intervals.records()]
    return {
        "load": report.stats.to_dict(),
        "tasks": {
            "count": report.stats.tasks,
            "send_tasks": report.stats.send_tasks,
            "by_config": report.configs.records(),
        },
        "stages": report.stages.records(),
        "hol": {**report.hol_overall, "by_config": report.hol_summary.records(), "intervals": intervals},
        "queue_depth": report.queue_depth.records(),
        "consumer_stall": report.consumer_stall.records(),
        "wait_explained": {
            "threshold_pct": 1.0,
            "listed": report.wait_explained_total,
            "rows": report.wait_explained.records(),
        },
        "resources": report.resources,
    }


def write_json(report: Report, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(report_to_dict(report), option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
    return path
