"""Resource records -> DuckDB table ``resources`` and its summary (peak, p50, p95, p99 per field).

Two inputs, one table: the sampler's per-step records (``resources-{run_id}.jsonl``) and OTLP/JSON metric
lines (``otlp-metrics-*.jsonl``: the sampler's no-endpoint exporter, or what ``kvtrace collect`` received
over OTLP), whose ``kvtrace.resource.*`` gauges are turned back into rows, one per exported step. A run
with per-step records is read from them only (its OTLP points are a subset of the same steps).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import duckdb
import orjson

from otel_kvtrace.resources.probe import FIELDS


RECORD_PREFIX, OTLP_PREFIX = "resources-", "otlp-metrics-"


def resource_files(paths: Iterable[str | Path]) -> list[Path]:
    """``resources-*.jsonl`` and ``otlp-metrics-*.jsonl`` files in the given files/directories (a data
    dir, its ``metrics/`` or ``traces/``, a ``kvtrace collect --out`` dir)."""
    found: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_file() and p.name.startswith((RECORD_PREFIX, OTLP_PREFIX)):
            found.append(p)
        elif p.is_dir():
            for d in (p, p / "metrics", p.parent / "metrics"):
                for prefix in (RECORD_PREFIX, OTLP_PREFIX):
                    found.extend(sorted(d.glob(f"{prefix}*.jsonl")))
    return sorted(set(found))


def _field_of_metric() -> dict[str, str]:
    from otel_kvtrace.resources.sampler import metric_name

    return {metric_name(f)[0]: f for f in ("step", *FIELDS)}


def _point_value(point: dict[str, Any]) -> int | None:
    value = point.get("asInt", point.get("asDouble"))
    return None if value is None else int(float(value))


def otlp_rows(line: bytes, fields: dict[str, str]) -> list[tuple[str, dict[str, Any]]]:
    """(run_id, row) per (resource, point time) of the ``kvtrace.resource.*`` gauges in one OTLP/JSON line.

    Raises ``ValueError``/``TypeError``/``KeyError`` for a line that is not an OTLP/JSON metrics request."""
    doc = orjson.loads(line)
    if not isinstance(doc, dict) or not isinstance(doc.get("resourceMetrics", []), list):
        raise TypeError("not an OTLP/JSON metrics request (no resourceMetrics list)")
    out: list[tuple[str, dict[str, Any]]] = []
    for rm in doc.get("resourceMetrics", []):
        attrs = {a["key"]: a.get("value", {}) for a in rm.get("resource", {}).get("attributes", [])}
        run_id = str(attrs.get("kvtrace.run_id", {}).get("stringValue", ""))
        by_time: dict[int, dict[str, Any]] = {}
        for sm in rm.get("scopeMetrics", []):
            for metric in sm.get("metrics", []):
                field = fields.get(metric.get("name", ""))
                for point in (metric.get("gauge") or {}).get("dataPoints", []) if field else ():
                    t = int(point["timeUnixNano"])
                    by_time.setdefault(t, {"t_unix_ns": t})[field] = _point_value(point)
        out.extend((run_id, row) for _, row in sorted(by_time.items()) if row.get("step") is not None)
    return out


def load_resources(paths: Iterable[str | Path], con: duckdb.DuckDBPyConnection | None = None,
                   rejected: list[str] | None = None) -> duckdb.DuckDBPyConnection:
    """Create table ``resources`` (columns: file, t_unix_ns, step, one BIGINT per probe field).

    A line that is not a JSON object with integer ``t_unix_ns`` and ``step`` (e.g. the half-written last
    line of a killed server), or not an OTLP/JSON metrics request, is skipped and named in ``rejected`` as
    ``file:line: reason``. OTLP points of one run and step (re-exported while the step did not move) count once.
    """
    con = con if con is not None else duckdb.connect()
    cols = ", ".join(f"{f} BIGINT" for f in FIELDS)
    con.execute(f"CREATE OR REPLACE TABLE resources (file VARCHAR, t_unix_ns BIGINT, step BIGINT, {cols})")
    files = resource_files(paths)
    recorded = {p.name[len(RECORD_PREFIX):-len(".jsonl")] for p in files if p.name.startswith(RECORD_PREFIX)}
    fields, seen, rows = _field_of_metric(), set(), []
    for path in files:
        is_record = path.name.startswith(RECORD_PREFIX)
        for n, line in enumerate(path.read_bytes().splitlines(), 1):
            if not line.strip():
                continue
            try:
                recs = [("", orjson.loads(line))] if is_record else otlp_rows(line, fields)
                for run_id, rec in recs:
                    if not is_record and (run_id in recorded or (run_id, rec["step"]) in seen):
                        continue
                    seen.add((run_id, rec["step"]))
                    rows.append([str(path), int(rec["t_unix_ns"]), int(rec["step"]),
                                 *(None if rec.get(f) is None else int(rec[f]) for f in FIELDS)])
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
                if rejected is not None:
                    rejected.append(f"{path}:{n}: {type(exc).__name__}: {exc}")
                continue
    if rows:
        con.executemany(f"INSERT INTO resources VALUES ({', '.join(['?'] * (3 + len(FIELDS)))})", rows)
    return con


def resource_summary(con: duckdb.DuckDBPyConnection) -> dict[str, dict[str, Any]]:
    """Per field: samples, peak, p50, p95, p99 (fields never sampled are left out)."""
    out: dict[str, dict[str, Any]] = {}
    for f in FIELDS:
        n, peak, p50, p95, p99 = con.execute(
            f"SELECT count({f}), max({f}), quantile_cont({f}, 0.5), quantile_cont({f}, 0.95), "
            f"quantile_cont({f}, 0.99) FROM resources").fetchone()
        if n:
            out[f] = {"samples": int(n), "peak": int(peak), "p50": float(p50), "p95": float(p95), "p99": float(p99)}
    return out


def resource_report(paths: Iterable[str | Path]) -> dict[str, Any]:
    """What reports show of the resource series beside ``paths``: ``files``, per-field ``summary``
    (``resource_summary``) and the ``skipped`` lines (``file:line: reason``); empty when there are none."""
    files = resource_files(paths)
    if not files:
        return {}
    rejected: list[str] = []
    con = load_resources(files, rejected=rejected)
    try:
        return {"files": [str(p) for p in files], "summary": resource_summary(con), "skipped": rejected}
    finally:
        con.close()


def print_resources(resources: dict[str, Any], console: Any) -> bool:
    """A "Resources" table (peak and percentiles per field) from ``resource_report``'s result."""
    if not resources:
        return False
    from rich.table import Table

    rejected: list[str] = resources["skipped"]
    table = Table(title="Resources per step (otel_kvtrace.resources)", title_justify="left")
    for col in ("resource", "samples", "peak", "p50", "p95", "p99"):
        table.add_column(col, justify="left" if col == "resource" else "right")
    for field, s in resources["summary"].items():
        scale, name = (1, field)
        if field.endswith("_bytes"):
            scale, name = (1 / 2**20, field.replace("_bytes", " MiB")) if s["peak"] > 2**20 else (1 / 1024, field.replace("_bytes", " KiB"))
        table.add_row(name, str(s["samples"]), *(f"{s[k] * scale:.1f}" for k in ("peak", "p50", "p95", "p99")))
    console.print(table)
    if rejected:
        console.print(f"{len(rejected)} resource line(s) skipped: " + "; ".join(rejected[:5]), markup=False)
    return True
