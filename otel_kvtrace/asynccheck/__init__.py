"""Async-scheduling check: engine-loop instrumentation, replica, importers, analysis and doctor.

Public API (the ``kvtrace async`` commands wrap these): ``check``, ``compare``, ``doctor``,
``run_replica``. Imports are lazy so that ``import otel_kvtrace.asynccheck`` stays cheap.
"""

from __future__ import annotations

from typing import Any

__all__ = ["check", "compare", "doctor", "run_replica", "ReplicaConfig"]

_LAZY = {
    "check": "otel_kvtrace.asynccheck.analysis",
    "compare": "otel_kvtrace.asynccheck.analysis",
    "doctor": "otel_kvtrace.asynccheck.doctor",
    "run_replica": "otel_kvtrace.asynccheck.replica",
    "ReplicaConfig": "otel_kvtrace.asynccheck.replica",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(name)
    import importlib

    return getattr(importlib.import_module(module), name)
