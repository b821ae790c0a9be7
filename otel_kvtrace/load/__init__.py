"""Load OTLP/JSON trace lines (local sink or OpenTelemetry Collector file exporter) into DuckDB.

``load_traces(paths)`` returns a connection with two tables, ``spans`` and ``tasks``, whose columns are
fixed by ``docs/schema.md``; ``queries/*.sql`` and ``otel_kvtrace.analyse`` read only those tables.
"""

from otel_kvtrace.load.clean import MalformedLine
from otel_kvtrace.load.files import LoadError, resolve_inputs
from otel_kvtrace.load.loader import LoadResult, LoadStats, NoTasksError, cache_key, load_traces
from otel_kvtrace.load.tasks_sql import DEPENDENCY_WAIT_STAGES, STAGES, tasks_columns

__all__ = [
    "DEPENDENCY_WAIT_STAGES",
    "STAGES",
    "LoadError",
    "LoadResult",
    "LoadStats",
    "MalformedLine",
    "NoTasksError",
    "cache_key",
    "load_traces",
    "resolve_inputs",
    "tasks_columns",
]
