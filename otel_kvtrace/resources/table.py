"""Resource records -> DuckDB table ``resources`` and its summary (peak, p50, p95, p99 per field)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import duckdb
import orjson

from otel_kvtrace.resources.probe import FIELDS


def resource_files(paths: Iterable[str | Path]) -> list[Path]:
    """``resources-*.jsonl`` files in the given files/directories (a data dir, its ``metrics/`` or ``traces/``)."""
    found: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_file() and p.name.startswith("resources-"):
            found.append(p)
        elif p.is_dir():
            for d in (p, p / "metrics", p.parent / "metrics"):
                found.extend(sorted(d.glob("resources-*.jsonl")))
    return sorted(set(found))


def load_resources(paths: Iterable[str | Path], con: duckdb.DuckDBPyConnection | None = None,
                   rejected: list[str] | None = None) -> duckdb.DuckDBPyConnection:
    """Create table ``resources`` (columns: file, t_unix_ns, step, one BIGINT per probe field).

    A line that is not a JSON object with integer ``t_unix_ns`` and ``step`` (e.g. the half-written last
    line of a killed server) is skipped and named in ``rejected`` as ``file:line: reason``.
    """
    con = con if con is not None else duckdb.connect()
    cols = ", ".join(f"{f} BIGINT" for f in FIELDS)
    con.execute(f"CREATE OR REPLACE TABLE resources (file VARCHAR, t_unix_ns BIGINT, step BIGINT, {cols})")
    rows = []
    for path in resource_files(paths):
        for n, line in enumerate(path.read_bytes().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = orjson.loads(line)
                row = [str(path), int(rec["t_unix_ns"]), int(rec["step"]),
                       *(None if rec.get(f) is None else int(rec[f]) for f in FIELDS)]
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                if rejected is not None:
                    rejected.append(f"{path}:{n}: {type(exc).__name__}: {exc}")
                continue
            rows.append(row)
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


def print_resources(paths: Iterable[str | Path], console: Any) -> bool:
    """A "Resources" table (peak and percentiles per field) when resource records lie beside the traces."""
    if not resource_files(paths):
        return False
    from rich.table import Table

    rejected: list[str] = []
    summary = resource_summary(load_resources(paths, rejected=rejected))
    table = Table(title="Resources per step (otel_kvtrace.resources)", title_justify="left")
    for col in ("resource", "samples", "peak", "p50", "p95", "p99"):
        table.add_column(col, justify="left" if col == "resource" else "right")
    for field, s in summary.items():
        scale, name = (1, field)
        if field.endswith("_bytes"):
            scale, name = (1 / 2**20, field.replace("_bytes", " MiB")) if s["peak"] > 2**20 else (1 / 1024, field.replace("_bytes", " KiB"))
        table.add_row(name, str(s["samples"]), *(f"{s[k] * scale:.1f}" for k in ("peak", "p50", "p95", "p99")))
    console.print(table)
    if rejected:
        console.print(f"{len(rejected)} resource line(s) skipped: " + "; ".join(rejected[:5]), markup=False)
    return True
