"""docs/async_check.md is the contract: every span, attribute, table column and warning kind is listed."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb

from otel_kvtrace.asynccheck import model as m
from otel_kvtrace.asynccheck.replica import ReplicaConfig, run_replica
from otel_kvtrace.asynccheck.tables import SCHEMA

DOC = (Path(__file__).resolve().parents[2] / "docs" / "async_check.md").read_text()


def test_every_emitted_span_name_and_attribute_is_documented(tmp_path: Path) -> None:
    path = run_replica(ReplicaConfig(mode="async", num_steps=3), out_dir=tmp_path)
    names: set[str] = set()
    keys: set[str] = set()
    for line in path.read_text().splitlines():
        for rs in json.loads(line)["resourceSpans"]:
            keys |= {kv["key"] for kv in rs["resource"]["attributes"]}
            for ss in rs["scopeSpans"]:
                for span in ss["spans"]:
                    names.add(span["name"])
                    keys |= {kv["key"] for kv in span.get("attributes", [])}
    missing = sorted(x for x in names | keys if f"`{x}`" not in DOC)
    assert not missing, f"not in docs/async_check.md: {missing}"


def test_every_table_column_is_documented() -> None:
    con = duckdb.connect()
    con.execute(SCHEMA)
    rows = con.execute(
        "SELECT table_name, column_name FROM information_schema.columns WHERE table_name LIKE 'async_%'"
    ).fetchall()
    assert {t for t, _ in rows} == {"async_spans", "async_steps", "async_markers", "async_warnings",
                                    "async_import_errors", "async_requests"}
    for table, column in rows:
        line = next(ln for ln in DOC.splitlines() if ln.startswith(f"| `{table}` |"))
        assert column in line, f"{table}.{column} not documented"


def test_every_warning_kind_and_marker_is_documented() -> None:
    kinds = [v for k, v in vars(m).items() if k.startswith(("WARN_", "MARKER_"))]
    missing = [k for k in kinds if f"`{k}`" not in DOC]
    assert not missing, missing
