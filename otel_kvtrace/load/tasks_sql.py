"""SQL deriving the ``tasks`` table (one row per trace of a ``kvtrace.recv.task`` root) from ``spans`` (docs/schema.md).

Column names are the root attributes without the ``kvtrace.`` prefix and with ``.`` replaced by ``_``,
then the configuration/resource columns, then ``<stage>_start, <stage>_end, <stage>_ns`` for every child
span name. A stage that appears more than once in a trace is taken the way the schema folds a stage that
ran several times into one span: first start to last end (``_ns = _end - _start``).
"""

from __future__ import annotations

from otel_kvtrace.record.model import (
    COMPLETION_SPAN,
    CONSUMER_WAIT_SPAN,
    QUEUE_WAIT_SPAN,
    RECV_ROOT_SPAN,
    SEND_ROOT_SPAN,
    STAGE_SPAN_NAMES,
)

RECV_ROOT = RECV_ROOT_SPAN
SEND_ROOT = SEND_ROOT_SPAN

STAGES: tuple[str, ...] = (
    QUEUE_WAIT_SPAN,
    *(name for name in STAGE_SPAN_NAMES if name != CONSUMER_WAIT_SPAN),
    COMPLETION_SPAN,
    CONSUMER_WAIT_SPAN,
)
"""Child span names in pipeline order (docs/schema.md)."""

DEPENDENCY_WAIT_STAGES: tuple[str, ...] = (
    "save_cpu_wait",
    "save_npu_sync",
    "gate_cond_wait",
    "gate_npu_sync",
    "slot_release_wait",
)
"""The stages that make up a head's dependency wait W_h (design.md section 4)."""

RECV_THREAD_STAGES: tuple[str, ...] = tuple(s for s in STAGES if s != "consumer_wait")
"""Stages that run one after another on the recv thread between enqueue and completion."""

DEPS: tuple[str, ...] = ("save_cpu", "save_npu", "gate_record", "gate_npu", "slot_release")

_ROOT_ATTRIBUTES: tuple[tuple[str, str], ...] = (
    ("correlation_id", "VARCHAR"),
    ("queue", "VARCHAR"),
    ("path", "VARCHAR"),
    ("seq", "BIGINT"),
    ("step", "BIGINT"),
    ("layer_id", "BIGINT"),
    ("final_layer", "BOOLEAN"),
    ("wait_for_save_layer", "BIGINT"),
    ("gate_id", "BIGINT"),
    ("num_blocks", "BIGINT"),
    ("bytes", "BIGINT"),
    ("queue_depth_at_enqueue", "BIGINT"),
    ("inflight_at_enqueue", "BIGINT"),
    ("outcome", "VARCHAR"),
    ("ts.enqueue", "BIGINT"),
    ("ts.dequeue", "BIGINT"),
    ("ts.ready", "BIGINT"),
    ("ts.ready_lo", "BIGINT"),
    ("ts.complete", "BIGINT"),
    *((f"ts.dep.{dep}{suffix}", "BIGINT") for dep in DEPS for suffix in ("", "_lo", "_hi")),
    ("ready_precision", "VARCHAR"),
)

CONFIG_COLUMNS: tuple[str, ...] = (
    "cfg_label",
    "cfg_num_layers",
    "cfg_prefetch_layers",
    "cfg_num_shared_buffers",
    "cfg_independent_layers",
    "cfg_buffer_reuse",
    "cfg_scheduler",
    "run_id",
    "source",
)


def tasks_columns() -> list[str]:
    """Every column of ``tasks`` in order (used by tests and the docs)."""
    cols = [attr.replace(".", "_") for attr, _ in _ROOT_ATTRIBUTES]
    cols += ["group_ids", "request_ids", "trace_id", "span_id", "status_code", "start_ns", "end_ns"]
    cols += list(CONFIG_COLUMNS)
    for stage in STAGES:
        cols += [f"{stage}_start", f"{stage}_end", f"{stage}_ns"]
    return cols


def create_tasks_sql(raw: str = "_kvtrace_spans", table: str = "tasks", *, one_root_per_trace: bool = True) -> str:
    """``CREATE TABLE tasks`` from the physical spans table (attribute lists, not the ``spans`` view).

    ``one_root_per_trace`` keeps the earliest recv root of each trace. The window costs ~40% of this
    statement, so the loader turns it off when it has checked that no trace has two recv roots."""
    def value(attr: str) -> str:
        return f"attributes[list_position(attr_keys, 'kvtrace.{attr}')].value"

    def typed(attr: str, sql_type: str) -> str:
        """The attribute in its OTLP value field, tolerating a writer that sent it as a string."""
        v = value(attr)
        if sql_type == "BIGINT":
            return f"TRY_CAST(coalesce({v}.intValue, {v}.stringValue) AS BIGINT)"
        if sql_type == "BOOLEAN":
            return f"coalesce({v}.boolValue, TRY_CAST({v}.stringValue AS BOOLEAN))"
        return f"coalesce({v}.stringValue, {v}.intValue)"

    root_cols = ",\n       ".join(
        f"{typed(attr, sql_type)} AS {attr.replace('.', '_')}" for attr, sql_type in _ROOT_ATTRIBUTES
    )
    status = ("coalesce(TRY_CAST(status_code AS INTEGER), "
              "CASE status_code WHEN 'STATUS_CODE_ERROR' THEN 2 WHEN 'STATUS_CODE_OK' THEN 1 ELSE 0 END)")
    stage_aggs = ",\n           ".join(
        f"min(start_ns) FILTER (WHERE name = '{s}') AS {s}_start, "
        f"max(end_ns) FILTER (WHERE name = '{s}') AS {s}_end"
        for s in STAGES
    )
    stage_cols = ", ".join(f"st.{s}_start, st.{s}_end, st.{s}_end - st.{s}_start AS {s}_ns" for s in STAGES)
    names = ", ".join(f"'{s}'" for s in STAGES)
    qualify = ("QUALIFY row_number() OVER (PARTITION BY trace_id ORDER BY start_ns, span_id) = 1"
               if one_root_per_trace else "")
    return f"""
CREATE OR REPLACE TABLE {table} AS
WITH root_spans AS (
    -- A key list and positional lookups instead of a MAP: building a MAP (or a list of every value as
    -- text) costs several times more than the ~38 lookups it would save.
    -- One row per trace: a task loaded twice (the same file under two names, an export retried) would
    -- otherwise be a later task of its own queue in hol_intervals and fan out every join on the queue.
    SELECT *, list_transform(attributes, lambda a: a.key) AS attr_keys
    FROM {raw} WHERE name = '{RECV_ROOT}'
    {qualify}
),
roots AS (
    SELECT {root_cols},
       TRY_CAST(json_extract_string({value('group_ids')}.arrayValue, '$.values[*].*') AS BIGINT[]) AS group_ids,
       json_extract_string({value('request_ids')}.arrayValue, '$.values[*].*') AS request_ids,
       trace_id, span_id, {status} AS status_code, start_ns, end_ns,
       {", ".join(CONFIG_COLUMNS)}
    FROM root_spans
),
stages AS (
    SELECT trace_id,
           {stage_aggs}
    FROM {raw}
    WHERE name IN ({names}) AND parent_span_id IS NOT NULL
    GROUP BY trace_id
)
SELECT roots.*, {stage_cols}
FROM roots LEFT JOIN stages AS st USING (trace_id)
"""
