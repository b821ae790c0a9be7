"""Resource records -> DuckDB table ``resources`` and its summary (peak, p50, p95, p99 per field)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import duckdb

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


def load_resources(paths: Iterable[str | Path], con: duckdb.DuckDBPyConnection | None = None
                   ) -> duckdb.DuckDBPyConnection:
    """Create table ``resources`` (columns: file, t_unix_ns, step, one BIGINT per probe field)."""
    con = con if con is not None else duckdb.connect()
    cols = ", ".join(f"{f} BIGINT" for f in FIELDS)
    con.execute(f"CREATE OR REPLACE TABLE resources (file VARCHAR, t_unix_ns BIGINT, step BIGINT, {cols})")
    files = resource_files(paths)
    if files:
        spec = "{" + ", ".join([f"'{c}': 'BIGINT'" for c in ("t_unix_ns", "step", *FIELDS)]) + "}"
        con.execute(f"INSERT INTO resources SELECT filename, t_unix_ns, step, {', '.join(FIELDS)} "
                    f"FROM read_json(?, format='newline_delimited', columns={spec}, filename=true)",
                    [[str(f) for f in files]])
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

    summary = resource_summary(load_resources(paths))
    table = Table(title="Resources per step (otel_kvtrace.resources)", title_justify="left")
    for col in ("resource", "samples", "peak", "p50", "p95", "p99"):
        table.add_column(col, justify="left" if col == "resource" else "right")
    for field, s in summary.items():
        scale, name = (1, field)
        if field.endswith("_bytes"):
            scale, name = (1 / 2**20, field.replace("_bytes", " MiB")) if s["peak"] > 2**20 else (1 / 1024, field.replace("_bytes", " KiB"))
        table.add_row(name, str(s["samples"]), *(f"{s[k] * scale:.1f}" for k in ("peak", "p50", "p95", "p99")))
    console.print(table)
    return True
