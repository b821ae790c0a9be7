"""SQL deriving the ``tasks`` table (one row per ``kvtrace.recv.task`` root) from ``spans`` (docs/schema.md).

Column names are the root attributes without the ``kvtrace.`` prefix and with ``.`` replaced by ``_``,
then the configuration/resource columns, then ``<stage>_start, <stage>_end, <stage>_ns`` for every child
span name. A stage that appears more than once in a trace is taken the way the schema folds a stage that
ran several times into one span: first start to last end (``_ns = _end - _start``).
"""

from __future__ import annotations

from otel_kvtrace.load.otlp_sql import ATTR_TEXT

RECV_ROOT = "kvtrace.recv.task"
SEND_ROOT = "kvtrace.send.task"

STAGES: tuple[str, ...] = (
    "queue_wait",
    "save_cpu_wait",
    "save_npu_sync",
    "gate_cond_wait",
    "gate_npu_sync",
    "meta_build",
    "h2d_stagger",
    "slot_release_wait",
    "backend_submit",
    "completion",
    "consumer_wait",
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


def create_tasks_sql(raw: str = "_kvtrace_spans", table: str = "tasks") -> str:
    """``CREATE TABLE tasks`` from the physical spans table (attribute lists, not the ``spans`` view)."""
    def value(attr: str) -> str:
        return f"attr_values[list_position(attr_keys, 'kvtrace.{attr}')]"

    root_cols = ",\n       ".join(
        f"TRY_CAST({value(attr)} AS {sql_type}) AS {attr.replace('.', '_')}"
        if sql_type != "VARCHAR"
        else f"{value(attr)} AS {attr.replace('.', '_')}"
        for attr, sql_type in _ROOT_ATTRIBUTES
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
    return f"""
CREATE OR REPLACE TABLE {table} AS
WITH root_spans AS (
    -- Two parallel lists instead of a MAP: building a MAP costs ~3x more than the lookups it saves.
    SELECT *, list_transform(attributes, lambda a: a.key) AS attr_keys,
           list_transform(attributes, lambda a: {ATTR_TEXT}) AS attr_values
    FROM {raw} WHERE name = '{RECV_ROOT}'
),
roots AS (
    SELECT {root_cols},
       TRY_CAST(json_extract_string({value('group_ids')}, '$.values[*].*') AS BIGINT[]) AS group_ids,
       json_extract_string({value('request_ids')}, '$.values[*].*') AS request_ids,
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
