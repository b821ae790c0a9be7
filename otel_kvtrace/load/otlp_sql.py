"""DuckDB SQL that flattens OTLP/JSON lines into rows of the spans table (docs/schema.md).

Why this shape (measured on DuckDB 2.0.1, 2 vCPU, 875k spans): ``read_json`` with a nested ``columns=``
schema took ~6 s of CPU; ``read_json_objects`` + one ``json_transform`` per line into a fixed STRUCT
takes ~3 s, and ``json_extract`` per field ~4 s (each call re-parses the span). Two traps avoided:

- an expression on the resourceSpans entry evaluated *beside* an ``unnest`` of its spans is re-evaluated
  for every span (a 200 KB line parsed once per span), so resource columns get their own CTE level;
- building a MAP of every span's attributes at load time costs as much as the parse itself, so the
  physical table keeps the parsed attribute list and the ``spans`` view builds ``attrs`` only when read.
"""

from __future__ import annotations

import json

from otel_kvtrace.export.otlp_json import MAX_LINE_BYTES
from otel_kvtrace.record.model import RECV_ROOT_SPAN

RESOURCE_COLUMNS: dict[str, tuple[str, str]] = {
    # column: (resource attribute, SQL type)
    "service_name": ("service.name", "VARCHAR"),
    "run_id": ("kvtrace.run_id", "VARCHAR"),
    "source": ("kvtrace.source", "VARCHAR"),
    "cfg_label": ("kvtrace.cfg.label", "VARCHAR"),
    "cfg_num_layers": ("kvtrace.cfg.num_layers", "BIGINT"),
    "cfg_prefetch_layers": ("kvtrace.cfg.prefetch_layers", "BIGINT"),
    "cfg_num_shared_buffers": ("kvtrace.cfg.num_shared_buffers", "BIGINT"),
    "cfg_independent_layers": ("kvtrace.cfg.independent_layers", "VARCHAR"),
    "cfg_buffer_reuse": ("kvtrace.cfg.buffer_reuse", "BOOLEAN"),
    "cfg_scheduler": ("kvtrace.cfg.scheduler", "VARCHAR"),
    "role": ("kvtrace.role", "VARCHAR"),
    "vllm_ascend_version": ("vllm_ascend.version", "VARCHAR"),
    "rank_tp": ("kvtrace.rank.tp", "BIGINT"),
    "rank_tp_size": ("kvtrace.rank.tp_size", "BIGINT"),
    "rank_dp": ("kvtrace.rank.dp", "BIGINT"),
    "rank_pp": ("kvtrace.rank.pp", "BIGINT"),
    "rank_pcp": ("kvtrace.rank.pcp", "BIGINT"),
    "rank_dcp": ("kvtrace.rank.dcp", "BIGINT"),
    "pid": ("process.pid", "BIGINT"),
    "host_name": ("host.name", "VARCHAR"),
}

_VALUE_TYPE = (
    "STRUCT(stringValue VARCHAR, intValue VARCHAR, boolValue BOOLEAN, doubleValue DOUBLE, arrayValue JSON)"
)
ATTRIBUTES_TYPE = f"STRUCT(key VARCHAR, value {_VALUE_TYPE})[]"
"""OTLP attributes as DuckDB parses them: a list of ``{key, value:{stringValue|intValue|...}}``."""

RAW_SPAN_COLUMNS: dict[str, str] = {
    "trace_id": "VARCHAR",
    "span_id": "VARCHAR",
    "parent_span_id": "VARCHAR",
    "name": "VARCHAR",
    "start_ns": "BIGINT",
    "end_ns": "BIGINT",
    "dur_ns": "BIGINT",
    "status_code": "VARCHAR",
    "status_message": "VARCHAR",
    "attributes": ATTRIBUTES_TYPE,
    **{column: sql_type for column, (_, sql_type) in RESOURCE_COLUMNS.items()},
    "exporter_dropped": "BIGINT",
    "file": "VARCHAR",
}
"""Columns of the physical table ``_kvtrace_spans`` (one row per span, attributes as parsed)."""

_ATTR_STRUCT = {"key": "VARCHAR", "value": {
    "stringValue": "VARCHAR", "intValue": "VARCHAR", "boolValue": "BOOLEAN", "doubleValue": "DOUBLE",
    "arrayValue": "JSON"}}
_SPAN_STRUCT = {
    "traceId": "VARCHAR", "spanId": "VARCHAR", "parentSpanId": "VARCHAR", "name": "VARCHAR",
    "startTimeUnixNano": "VARCHAR", "endTimeUnixNano": "VARCHAR",  # checked as text: see _span_bad_sql
    "status": {"code": "VARCHAR", "message": "VARCHAR"}, "attributes": [_ATTR_STRUCT],
}
REQUEST_STRUCT = json.dumps({"resourceSpans": [{
    "resource": {"attributes": [_ATTR_STRUCT]},
    "scopeSpans": [{"scope": {"attributes": [_ATTR_STRUCT]}, "spans": [_SPAN_STRUCT]}]}]})
"""The part of an ExportTraceServiceRequest the loader reads; anything else in a line is ignored."""

ATTR_TEXT = ("coalesce(a.value.stringValue, a.value.intValue, a.value.boolValue::VARCHAR, "
             "a.value.doubleValue::VARCHAR, a.value.arrayValue::VARCHAR)")
"""An attribute value as text (``a`` is one attribute); arrays stay JSON: ``{"values":[...]}``."""


def attrs_map_sql(column: str = "attributes") -> str:
    """SQL turning an OTLP attribute list into ``MAP(VARCHAR, VARCHAR)`` (see ``BAD_SPAN_CONDITION``)."""
    return f"map_from_entries(list_transform({column}, lambda a: (a.key, {ATTR_TEXT})))"


def create_raw_spans_sql(table: str) -> str:
    """``CREATE TABLE`` for an empty ``_kvtrace_spans``-shaped table."""
    cols = ", ".join(f"{name} {sql_type}" for name, sql_type in RAW_SPAN_COLUMNS.items())
    return f"CREATE TABLE {table} ({cols})"


NON_STRICT_JSON = r"(?i),\s*[\]}]|[:,\[]\s*[-+]?(nan|inf)"
"""What DuckDB's JSON reader accepts and strict JSON does not (trailing commas, NaN, Infinity); a line that
matches (also, harmlessly, a string that merely contains such text) is checked by the cleaner."""


def _attrs_bad_sql(column: str) -> str:
    """True when some attribute of ``column`` breaks a rule of ``clean.attr_problem`` (or may: the cleaner
    decides). NULL lists are fine; the checks run on the parsed lists, not on the text."""
    count = " + ".join(f"(a.value.{f} IS NOT NULL)::INT" for f in
                       ("stringValue", "intValue", "boolValue", "doubleValue", "arrayValue"))
    per_attr = (f"a IS NULL OR a.key IS NULL OR left(a.key, 1) IN ('{{', '[') OR a.value IS NULL OR ({count}) <> 1 "
                # canonical int64 text: the cast round-trips (no '+', spaces, leading zeros, '1e3', overflow)
                "OR TRY_CAST(a.value.intValue AS BIGINT)::VARCHAR IS DISTINCT FROM a.value.intValue")
    return (f"coalesce(list_bool_or(list_transform({column}, lambda a: {per_attr})) "
            f"OR len(list_distinct(list_transform({column}, lambda a: a.key))) <> len({column}), false)")


def _span_bad_sql(s: str = "s") -> str:
    """True when the span row may break a rule of ``clean.span_problem``."""
    times = " OR ".join(f"coalesce(TRY_CAST({s}.{key} AS BIGINT)::VARCHAR <> {s}.{key} "
                        f"OR TRY_CAST({s}.{key} AS BIGINT) < 0, true)" for key in ("startTimeUnixNano", "endTimeUnixNano"))
    return (f"{s} IS NULL OR NOT regexp_full_match(coalesce({s}.traceId, ''), '[0-9a-fA-F]{{32}}') "
            f"OR NOT regexp_full_match(coalesce({s}.spanId, ''), '[0-9a-fA-F]{{16}}') "
            f"OR ({s}.parentSpanId <> '' AND NOT regexp_full_match({s}.parentSpanId, '[0-9a-fA-F]{{16}}')) "
            f"OR {s}.name IS NULL OR {s}.name = '' OR left({s}.name, 1) IN ('{{', '[') OR {times} "
            f"OR {_attrs_bad_sql(f'{s}.attributes')}")


def _unnest_or_null(column: str) -> str:
    """``unnest`` that yields one NULL for a NULL list, so a missing or ill-typed container reaches the
    span level as a row the screen flags instead of vanishing."""
    return f"unnest(CASE WHEN {column} IS NULL THEN [NULL] ELSE {column} END)"


def insert_spans_sql(table: str, screen: bool = True) -> str:
    """``INSERT`` of every span of the files in parameter ``$files`` (a list of paths) into ``table``.

    ``json_transform`` parses each line once into the typed shape ``REQUEST_STRUCT`` (fields that do not
    fit become NULL). The screen (the rules of ``clean.py`` in SQL) gives every span row that breaks or may
    break a rule, and a row for every line or container that is not OTLP, a NULL ``trace_id``: the loader
    sends those files through the cleaner (``BAD_SPAN_CONDITION``). A line that is not JSON at all fails
    the statement. Resource columns are computed per resourceSpans entry in their own CTE level: an
    expression evaluated beside the ``unnest`` of the spans would be re-evaluated for every span.
    ``screen=False`` is for the cleaner's output, valid by construction.
    """
    doc = (f"CASE WHEN NOT regexp_matches(json, '{NON_STRICT_JSON}') THEN json_transform(json, '{REQUEST_STRUCT}') END"
           if screen else f"json_transform(json, '{REQUEST_STRUCT}')")
    unnest = _unnest_or_null if screen else (lambda column: f"unnest({column})")
    res_bad = _attrs_bad_sql("rs.resource.attributes") if screen else "false"
    trace_id = f"CASE WHEN res_bad OR {_span_bad_sql()} THEN NULL ELSE s.traceId END" if screen else "s.traceId"
    res_cols = ",\n        ".join(
        f"TRY_CAST(res[{attr!r}] AS {sql_type}) AS {column}" if sql_type != "VARCHAR" else f"res[{attr!r}] AS {column}"
        for column, (attr, sql_type) in RESOURCE_COLUMNS.items()
    )
    res_names = ", ".join(RESOURCE_COLUMNS)
    return f"""
INSERT INTO {table}
WITH docs AS (
    SELECT filename, {doc} AS d
    FROM read_json_objects($files, format = 'newline_delimited', filename = true,
                           maximum_object_size = {MAX_LINE_BYTES})
),
resource_spans AS (
    SELECT filename, {unnest("d.resourceSpans")} AS rs FROM docs
),
resource_maps AS (
    SELECT filename, {attrs_map_sql("rs.resource.attributes")} AS res, rs.scopeSpans AS scope_list,
           {res_bad} AS res_bad
    FROM resource_spans
),
resources AS (
    SELECT filename, scope_list, res_bad,
        {res_cols}
    FROM resource_maps
),
scopes AS (
    SELECT filename, {res_names}, res_bad, {unnest("scope_list")} AS ss FROM resources
),
scope_counts AS (
    -- The exporter's cumulative drop counter rides on every line's scope (docs/schema.md).
    SELECT filename, {res_names}, res_bad, ss.spans AS spans,
           TRY_CAST(list_extract(list_filter(ss.scope.attributes,
                                             lambda a: a.key = 'kvtrace.exporter.dropped'), 1).value.intValue
                    AS BIGINT) AS exporter_dropped
    FROM scopes
),
span_docs AS (
    SELECT filename, {res_names}, res_bad, exporter_dropped, {unnest("spans")} AS s FROM scope_counts
)
SELECT {trace_id}, s.spanId,
       nullif(s.parentSpanId, ''), s.name,
       TRY_CAST(s.startTimeUnixNano AS BIGINT), TRY_CAST(s.endTimeUnixNano AS BIGINT),
       TRY_CAST(s.endTimeUnixNano AS BIGINT) - TRY_CAST(s.startTimeUnixNano AS BIGINT),
       s.status.code, nullif(s.status.message, ''), s.attributes,
       {res_names}, exporter_dropped, filename
FROM span_docs
"""


BAD_SPAN_CONDITION = (
    "trace_id IS NULL OR span_id IS NULL OR name IS NULL OR start_ns IS NULL OR end_ns IS NULL"
)
"""Rows the screen flagged (``trace_id`` NULL) or that could not be typed: their file goes through the
line-by-line cleaner, which names every problem and keeps the valid rest."""


def duplicate_recv_roots_sql(raw: str) -> str:
    """Recv root spans whose trace id another recv root already has (``stats.duplicate_tasks``). Send
    roots are not tasks; counted before ``dedupe_spans_sql`` removes the copies."""
    return f"SELECT count(*) - count(DISTINCT trace_id) FROM {raw} WHERE name = '{RECV_ROOT_SPAN}'"


def duplicate_spans_sql(raw: str) -> str:
    """More than 0 when some span row may repeat an earlier (trace_id, span_id): the loader then runs the
    exact ``dedupe_spans_sql``. Distinct over a hash is half the cost of distinct over the two strings
    (0.23 s vs 0.46 s on 2.2M spans); a hash collision only costs a rewrite that deletes nothing."""
    return f"SELECT count(*) - count(DISTINCT hash(trace_id, span_id)) FROM {raw}"


def dedupe_spans_sql(raw: str) -> str:
    """``DELETE`` every copy of a (trace_id, span_id) but the first: the first file in parameter ``$files``
    (the input order), then the first row read. A copy would double every stage and HOL figure."""
    return f"""
DELETE FROM {raw} WHERE rowid IN (
    SELECT rowid FROM (
        SELECT rowid, row_number() OVER (PARTITION BY trace_id, span_id
                                         ORDER BY list_position($files, file), rowid) AS copy
        FROM {raw})
    WHERE copy > 1)
"""


def roots_table_sql(raw: str, table: str, tasks: str = "tasks") -> str:
    """Correlation id of every root span's trace, for the ``spans`` view: recv roots from ``tasks``
    (already extracted), other roots (send tasks) from their attribute list. ``roots`` is the number of
    root spans of the trace (1 once the loader has removed duplicated spans)."""
    return f"""
CREATE OR REPLACE TABLE {table} AS
SELECT trace_id, min(correlation_id) AS correlation_id, count(*) AS roots FROM (
    SELECT trace_id, correlation_id FROM {tasks} WHERE correlation_id IS NOT NULL
    UNION ALL
    SELECT trace_id,
           list_extract(list_filter(attributes, lambda a: a.key = 'kvtrace.correlation_id'), 1).value.stringValue
    FROM {raw} WHERE parent_span_id IS NULL AND name <> '{RECV_ROOT_SPAN}'
) WHERE correlation_id IS NOT NULL GROUP BY trace_id  -- one row per trace: the view must not fan out
"""


def spans_view_sql(raw: str, roots: str, view: str = "spans") -> str:
    """The public ``spans`` relation: raw rows plus ``correlation_id`` (inherited from the trace's root)
    and ``attrs`` (MAP of text values), both computed only when a query reads them."""
    return f"""
CREATE OR REPLACE VIEW {view} AS
SELECT r.trace_id, r.span_id, r.parent_span_id, r.name, r.start_ns, r.end_ns, r.dur_ns,
       coalesce(TRY_CAST(r.status_code AS INTEGER),
                CASE r.status_code WHEN 'STATUS_CODE_OK' THEN 1 WHEN 'STATUS_CODE_ERROR' THEN 2 ELSE 0 END)
           AS status_code,
       r.status_message, c.correlation_id, {attrs_map_sql("r.attributes")} AS attrs,
       {", ".join("r." + c for c in RESOURCE_COLUMNS)}, r.exporter_dropped, r.file
FROM {raw} AS r LEFT JOIN {roots} AS c USING (trace_id)
"""
