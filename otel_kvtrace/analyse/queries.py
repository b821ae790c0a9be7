"""The SQL files in ``queries/``: find them, read their documented headers, run them.

Each ``queries/<name>.sql`` is one SELECT over the tables ``spans``/``tasks`` with a header comment
(``-- name:``, ``-- requires:``, ``-- purpose:``, ``-- definition:``, optional ``-- parameters:``,
``-- columns:``). A query may build on
another one (``hol_summary`` reads ``hol_intervals``); ``run_query`` creates the ones it requires as
temporary views first, so every file stays a plain, readable SELECT. ``install_views`` creates a view per
query, so a database written by the loader can be explored from the DuckDB CLI
(``SELECT * FROM hol_summary``).

A parameter is a DuckDB variable read as ``coalesce(getvariable('name'), default)``, so the file stays
plain SQL (a view, the DuckDB CLI: ``SET VARIABLE timeline_tasks = 300``) and runs with its default when
unset; ``run_query(con, name, params={...})`` sets the variables for one run and resets them after.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import duckdb

from otel_kvtrace import config

QUERIES_ENV = config.OTEL_KVTRACE_QUERIES_DIR
"""Overrides where the ``.sql`` files are read from (default: the repository's ``queries/``)."""

_COLUMN_LINE = re.compile(r"^--\s{3,}(\w+)\s+([A-Z][A-Z0-9_\[\]()]*)\s+(.*)$")


@dataclass(slots=True)
class ColumnDoc:
    name: str
    type: str
    description: str


@dataclass(slots=True)
class QueryDoc:
    """A query file and its documented header."""

    name: str
    path: Path
    sql: str
    requires: list[str] = field(default_factory=list)
    purpose: str = ""
    columns: list[ColumnDoc] = field(default_factory=list)
    parameters: list[ColumnDoc] = field(default_factory=list)

    @property
    def query_dependencies(self) -> list[str]:
        """Other queries (not tables) this one reads."""
        return [r for r in self.requires if r not in ("spans", "tasks")]


@dataclass(slots=True)
class QueryResult:
    """Column names and rows of one query, with a dict view for JSON and templates."""

    columns: list[str]
    rows: list[tuple]

    def records(self) -> list[dict[str, Any]]:
        return [dict(zip(self.columns, row)) for row in self.rows]

    def column(self, name: str) -> list[Any]:
        index = self.columns.index(name)
        return [row[index] for row in self.rows]

    def to_frame(self) -> Any:
        """A pandas DataFrame of the rows (pandas comes with the ``dev`` extra, for notebooks)."""
        import pandas as pd

        return pd.DataFrame.from_records(self.rows, columns=self.columns)


def queries_dir() -> Path:
    """Directory holding the ``.sql`` files: ``$OTEL_KVTRACE_QUERIES_DIR``, else the repository's
    ``queries/`` (source checkout, editable install), else ``otel_kvtrace/sql/`` (where a wheel build can
    ship a copy: the ``sql/*.sql`` package-data pattern in pyproject.toml)."""
    override = os.environ.get(QUERIES_ENV)
    if override:
        return Path(override)
    package = Path(__file__).resolve().parents[1]
    repository = package.parent / "queries"
    return repository if repository.is_dir() else package / "sql"


def parse_header(path: Path) -> QueryDoc:
    """Read the ``-- key: value`` header and the ``-- columns:`` block of one query file."""
    sql = path.read_text()
    doc = QueryDoc(name=path.stem, path=path, sql=sql)
    section = ""
    for line in sql.splitlines():
        if not line.startswith("--"):
            break
        column = _COLUMN_LINE.match(line)
        if section in ("columns", "parameters") and column:
            (doc.columns if section == "columns" else doc.parameters).append(ColumnDoc(*column.groups()))
            continue
        match = re.match(r"^--\s?(\w+):\s*(.*)$", line)
        if match:
            section, value = match.group(1), match.group(2).strip()
            if section == "name":
                doc.name = value
            elif section == "requires":
                doc.requires = [r.strip() for r in value.split(",") if r.strip()]
            elif section == "purpose":
                doc.purpose = value
        elif section == "purpose":
            doc.purpose += " " + line.lstrip("- ").strip()
    return doc


@cache
def _load_all(directory: str) -> dict[str, QueryDoc]:
    return {p.stem: parse_header(p) for p in sorted(Path(directory).glob("*.sql"))}


def all_queries() -> dict[str, QueryDoc]:
    """Every query file by name."""
    return _load_all(str(queries_dir()))


def get_query(name: str) -> QueryDoc:
    queries = all_queries()
    if name not in queries:
        raise KeyError(f"no query {name!r} in {queries_dir()} (have: {', '.join(sorted(queries))})")
    return queries[name]


def _is_materialized(con: duckdb.DuckDBPyConnection, name: str) -> bool:
    return bool(con.execute("SELECT 1 FROM duckdb_tables() WHERE temporary AND table_name = $n",
                            {"n": name}).fetchall())


def _ensure_views(con: duckdb.DuckDBPyConnection, doc: QueryDoc, temporary: bool, done: set[str]) -> None:
    for dep in doc.query_dependencies:
        if dep in done or (temporary and _is_materialized(con, dep)):
            continue
        dep_doc = get_query(dep)
        _ensure_views(con, dep_doc, temporary, done)
        kind = "TEMP VIEW" if temporary else "VIEW"
        con.execute(f"CREATE OR REPLACE {kind} {dep} AS {dep_doc.sql}").fetchall()
        done.add(dep)


def _declared_parameters(doc: QueryDoc) -> set[str]:
    names = {p.name for p in doc.parameters}
    for dep in doc.query_dependencies:
        names |= _declared_parameters(get_query(dep))
    return names


@contextmanager
def _parameters(con: duckdb.DuckDBPyConnection, doc: QueryDoc, params: Mapping[str, Any] | None) -> Iterator[None]:
    """Set the query's ``-- parameters:`` as DuckDB variables for one run; an undeclared one is an error."""
    params = params or {}
    unknown = set(params) - _declared_parameters(doc)
    if unknown:
        raise KeyError(f"{doc.name}.sql declares no parameter {', '.join(sorted(unknown))}")
    for key, value in params.items():
        con.execute(f"SET VARIABLE {key} = $value", {"value": value}).fetchall()
    try:
        yield
    finally:
        for key in params:
            con.execute(f"RESET VARIABLE {key}").fetchall()


def run_query(con: duckdb.DuckDBPyConnection, name: str, params: Mapping[str, Any] | None = None) -> QueryResult:
    """Run ``queries/<name>.sql`` (after creating the queries it requires as temporary views), with
    ``params`` for the parameters its header declares."""
    doc = get_query(name)
    if _is_materialized(con, name):  # computed once by materialize(): read it, do not recompute
        cursor = con.execute(f"SELECT * FROM temp.{name}")
        return QueryResult([d[0] for d in cursor.description], cursor.fetchall())
    _ensure_views(con, doc, temporary=True, done=set())
    with _parameters(con, doc, params):
        cursor = con.execute(doc.sql)
        return QueryResult([d[0] for d in cursor.description], cursor.fetchall())


def install_views(con: duckdb.DuckDBPyConnection) -> list[str]:
    """Create one persistent view per query file (in dependency order); returns their names."""
    done: set[str] = set()
    for doc in all_queries().values():
        _ensure_views(con, doc, temporary=False, done=done)
        if doc.name not in done:
            con.execute(f"CREATE OR REPLACE VIEW {doc.name} AS {doc.sql}").fetchall()
            done.add(doc.name)
    return sorted(done)


def materialize(con: duckdb.DuckDBPyConnection, name: str, params: Mapping[str, Any] | None = None) -> str:
    """Compute query ``name`` once (with ``params``) into a temporary table of that name; later
    ``run_query`` calls that require it (and SQL selecting from it) read the table instead of recomputing."""
    doc = get_query(name)
    _ensure_views(con, doc, temporary=True, done=set())
    for (kind,) in con.execute(
            "SELECT 'VIEW' FROM duckdb_views() WHERE view_name = $n AND temporary "
            "UNION ALL SELECT 'TABLE' FROM duckdb_tables() WHERE table_name = $n AND temporary",
            {"n": name}).fetchall():
        con.execute(f"DROP {kind} IF EXISTS temp.{name}").fetchall()
    with _parameters(con, doc, params):
        con.execute(f"CREATE TEMP TABLE {name} AS {doc.sql}").fetchall()
    return name


def drop_materialized(con: duckdb.DuckDBPyConnection, name: str) -> None:
    """Drop the table ``materialize`` made, so a later load into ``con`` does not meet stale rows."""
    get_query(name)  # only query tables: never a loaded table by mistake
    con.execute(f"DROP TABLE IF EXISTS temp.{name}").fetchall()


def ensure_view(con: duckdb.DuckDBPyConnection, name: str) -> str:
    """Create ``name`` (and what it requires) as temporary views so other SQL can select from it."""
    if _is_materialized(con, name):
        return name
    doc = get_query(name)
    done: set[str] = set()
    _ensure_views(con, doc, temporary=True, done=done)
    con.execute(f"CREATE OR REPLACE TEMP VIEW {name} AS {doc.sql}").fetchall()
    return name
