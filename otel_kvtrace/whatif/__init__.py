"""What-if replay of recv-queue scheduling policies, the coverage sweep, and the FIFO verdict.

Public API: ``whatif`` (recorded traces -> verdict report), ``run_sweep`` / ``sweep_report`` (replica
coverage matrix -> verdict report), ``replay_run`` / ``replay_queue`` (the replay itself),
``ReplayTask`` and its builders, the policy registry (``get_policy``, ``policy_names``, ``Policy``).
See docs/whatif.md.
"""

from otel_kvtrace.whatif.api import sweep_report, whatif
from otel_kvtrace.whatif.engine import (
    QueueArrays,
    QueueReplay,
    ReplayStalled,
    replay_queue,
)
from otel_kvtrace.whatif.policy import Policy, get_policy, policy_names
from otel_kvtrace.whatif.replay import RunFigures, RunReplay, RunSummary, replay_run
from otel_kvtrace.whatif.sweep import SweepCell, SweepMatrix, SweepResult, run_sweep
from otel_kvtrace.whatif.task import (
    ReplayInputError,
    ReplayTask,
    tasks_from_duckdb,
    tasks_from_records,
    tasks_from_rows,
)
from otel_kvtrace.whatif.verdict import ConfigVerdict, decide

__all__ = [
    "ConfigVerdict",
    "Policy",
    "QueueArrays",
    "QueueReplay",
    "ReplayInputError",
    "ReplayStalled",
    "ReplayTask",
    "RunFigures",
    "RunReplay",
    "RunSummary",
    "SweepCell",
    "SweepMatrix",
    "SweepResult",
    "decide",
    "get_policy",
    "policy_names",
    "replay_queue",
    "replay_run",
    "run_sweep",
    "sweep_report",
    "tasks_from_duckdb",
    "tasks_from_records",
    "tasks_from_rows",
    "whatif",
]
