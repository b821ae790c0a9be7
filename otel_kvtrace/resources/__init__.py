"""Resource series of a serving run (host/NPU memory, tasks, metadata and leases in flight, backend depth).

``probe`` (what one sample reads), ``sampler`` (per-step records + OTel metrics), ``table`` (DuckDB table
``resources``, peaks and percentiles).
"""

from otel_kvtrace.resources.probe import FIELDS, sample_worker
from otel_kvtrace.resources.table import load_resources, resource_summary

__all__ = ["FIELDS", "load_resources", "resource_summary", "sample_worker"]
