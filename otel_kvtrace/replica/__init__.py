"""CPU replica of vLLM-Ascend's layerwise KV load/save pipeline (see docs/replica.md).

Two engines share one configuration and one layout module:

- ``simulate(cfg)`` / ``simulate_to_traces(cfg, out_dir)``: virtual clock, deterministic and fast;
- ``run_threaded(cfg)``: real threads on a fake NPU, upstream-shaped classes (``replica_targets()``) that
  the instrumentation attaches to exactly as it does to vLLM-Ascend.
"""

from otel_kvtrace.replica.config import ReplicaConfig, ReplicaConfigError, SlowInjection, Timing
from otel_kvtrace.replica.layout import ReuseLayout, Submission, build_layout, enqueue_plan
from otel_kvtrace.replica.simulate import (
    SimResult,
    StepOutcome,
    ready_time,
    simulate,
    simulate_to_recorder,
    simulate_to_traces,
)
from otel_kvtrace.replica.threaded import ThreadedResult, replica_targets, run_threaded

__all__ = [
    "ReplicaConfig",
    "ReplicaConfigError",
    "ReuseLayout",
    "SimResult",
    "SlowInjection",
    "StepOutcome",
    "Submission",
    "ThreadedResult",
    "Timing",
    "build_layout",
    "enqueue_plan",
    "ready_time",
    "replica_targets",
    "run_threaded",
    "simulate",
    "simulate_to_recorder",
    "simulate_to_traces",
]
