"""msServiceProfiler span/event names -> canonical async-check names, markers, and priorities.

MindIE and msServiceProfiler's vLLM patcher name the same phases differently (research §1.3, §6.4):
the batch schedule is ``BatchSchedule`` (MindIE, domain ``Schedule``) or ``batchFrameworkProcessing``
(vLLM patcher); the dispatch is ``modelExec`` / ``Execute`` / ``modelRunnerExec``. When a capture has
several, the lowest priority number wins so each step is counted once.
"""

from __future__ import annotations

import re
from typing import Any

from otel_kvtrace.asynccheck import model as m

ORIGIN_PRIORITY: dict[str, int] = {
    "BatchSchedule": 0,
    "batchFrameworkProcessing": 1,
    "modelExec": 0,
    "Execute": 1,
    "modelRunnerExec": 2,
    "forward(async)": 3,
}
SOURCE_PRIORITY: dict[str, int] = {
    "raw_db": 0,
    "mspti_db": 0,
    "profiler_db": 1,
    "chrome": 2,
    "batch_csv": 3,
    "forward_csv": 4,
}
"""One parse output holds the same spans several times (raw DB, profiler.db, chrome_tracing.json, CSVs):
each raw span name is taken from the best file kind that has it. ``forward.csv`` comes last: its fixed
column list drops MindIE's ``async`` attribute, so its forwards cannot tell a host launch from a
device-synchronised forward."""
VLLM_PATCHER_SPANS = frozenset({"batchFrameworkProcessing", "modelExec", "modelRunnerExec"})
MINDIE_PD_MESSAGES = frozenset(
    {"receiveReq", "sendReqToD", "sendReqToDSucc", "prefillRes", "decodeRes", "decodeReq", "releaseKvcacheRes"}
)
COMM_KERNEL_RE = re.compile(r"hcom|hccl|lccl|lcal|lcoc|allreduce|all_reduce|allgather|all_gather|reducescatter|"
                            r"reduce_scatter|alltoall|all_to_all|broadcast", re.IGNORECASE)
SYNC_HOOK_HANDLERS = ("record_function_or_nullcontext", "capture_async", "compute_logits", "sampler_forward")


def is_truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes")
    return bool(value)


def canonical(name: str, args: dict[str, Any], track: str = "") -> tuple[str | None, str]:
    """``(canonical name or None, origin)`` for one msServiceProfiler span.

    ``track`` is the chrome ``tid`` / thread kind (``Kernel`` and ``Api`` are MSPTI rows).
    """
    if track == "Kernel":
        return (m.COMMUNICATION if COMM_KERNEL_RE.search(name) else m.COMPUTE), name
    if track == "Api":
        return m.LAUNCH_API, name
    if name in ("BatchSchedule", "batchFrameworkProcessing"):
        return m.BATCH_SCHEDULE, name
    if name in ("modelExec", "Execute", "modelRunnerExec"):
        return m.MODEL_EXECUTE, name
    if name == "forward":
        if is_truthy(args.get("async")):
            return m.MODEL_EXECUTE, "forward(async)"
        return m.FORWARD, name
    if name.startswith("hcom_") or (track.startswith("HCCL") and COMM_KERNEL_RE.search(name)):
        return m.COMMUNICATION, name
    return None, name


def markers_of(name: str, args: dict[str, Any]) -> list[str]:
    """Async-path evidence carried by one span or event."""
    out: list[str] = []
    if name == "forward" and is_truthy(args.get("async")):
        out.append(m.MARKER_MINDIE_ASYNC_FORWARD)
    if name in m.MINDIE_ASYNC_ONLY_SPANS:
        out.append(m.MARKER_MINDIE_ASYNC_SPANS)
    if "asyncQueueDepth=" in args or "asyncDispatchCount=" in args:
        out.append(m.MARKER_ASYNC_METRICS)
    return out
