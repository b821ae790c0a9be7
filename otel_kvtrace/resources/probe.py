"""What one resource sample reads, from a ``KVPoolWorker`` (upstream-shaped: the replica's or vLLM-Ascend's).

Every read is an attribute read or a ``queue.Queue`` counter: nothing locks the transfer threads' queues,
nothing touches the NPU stream (torch_npu's ``memory_allocated`` / ``max_memory_allocated`` /
``memory_reserved`` read the caching allocator's counters and do not synchronise). Definitions:

- ``tasks_in_flight``: ``kv_recv_thread.request_queue.unfinished_tasks`` (queued + being handled);
  ``save_tasks_in_flight`` the same for ``kv_send_thread``;
- ``metadata_in_flight`` / ``metadata_bytes``: distinct ``SharedBlockData`` objects referenced by the
  queued load tasks, and the bytes of their ``block_ids_arr`` (``nbytes`` of a numpy array, else 8 per
  entry): the address arrays built for tasks that have not run yet;
- ``outstanding_leases``: distinct ``load_keys`` of those queued tasks (their leases are removed only
  after the final layer's copy, ``batch_remove_lease``);
- ``backend_copies_pending``: calls inside the backend's ``batch_copy`` (``m_store.store.pending_copies``,
  the replica's backend counter; absent on a real backend, reported as null);
- ``host_rss_bytes`` from ``/proc/self/statm``; ``npu_*`` only where ``torch_npu`` is already imported.
"""

from __future__ import annotations

import os
import sys
from typing import Any

FIELDS = (
    "host_rss_bytes", "npu_allocated_bytes", "npu_max_allocated_bytes", "npu_reserved_bytes",
    "tasks_in_flight", "save_tasks_in_flight", "metadata_in_flight", "metadata_bytes", "outstanding_leases",
    "backend_copies_pending",
)
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def host_rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm", "rb") as fh:
            return int(fh.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


def npu_memory() -> tuple[int | None, int | None, int | None]:
    """torch_npu allocator counters, only when the serving process already imported torch_npu."""
    if "torch_npu" not in sys.modules:
        return None, None, None
    try:
        import torch

        npu = torch.npu  # type: ignore[attr-defined]
        return int(npu.memory_allocated()), int(npu.max_memory_allocated()), int(npu.memory_reserved())
    except Exception:  # noqa: BLE001 - a probe never takes the server down
        return None, None, None


def _queued(thread: Any) -> list[Any]:
    q = getattr(thread, "request_queue", None)
    items = getattr(q, "queue", None)
    for _ in range(3):  # the deque may change while we copy it: retry, never lock
        try:
            return list(items) if items is not None else []
        except RuntimeError:
            continue
    return []


def _unfinished(thread: Any) -> int | None:
    q = getattr(thread, "request_queue", None)
    value = getattr(q, "unfinished_tasks", None)
    return int(value) if value is not None else None


def sample_memory() -> dict[str, int | None]:
    """Host RSS and the NPU allocator counters (read once per step record)."""
    allocated, max_allocated, reserved = npu_memory()
    return {"host_rss_bytes": host_rss_bytes(), "npu_allocated_bytes": allocated,
            "npu_max_allocated_bytes": max_allocated, "npu_reserved_bytes": reserved}


def sample_worker(worker: Any) -> dict[str, int | None]:
    """One sample of ``FIELDS`` (missing sources are ``None``)."""
    return {**sample_counters(worker), **sample_memory()}


def sample_counters(worker: Any) -> dict[str, int | None]:
    """The in-flight counters (polled several times per step; attribute reads only)."""
    recv, send = getattr(worker, "kv_recv_thread", None), getattr(worker, "kv_send_thread", None)
    shared: dict[int, Any] = {}
    for task in _queued(recv):
        for tt in getattr(task, "transfer_tasks", None) or ():
            data = getattr(tt, "shared_block_data", None)
            if data is not None:
                shared[id(data)] = data
    meta_bytes, keys = 0, set()
    for data in shared.values():
        arr = getattr(data, "block_ids_arr", None)
        if arr is not None:
            meta_bytes += int(getattr(arr, "nbytes", len(arr) * 8))
        keys.update(getattr(data, "load_keys", None) or ())
    store = getattr(getattr(worker, "m_store", None), "store", None)
    pending = getattr(store, "pending_copies", None)
    return {
        "tasks_in_flight": _unfinished(recv), "save_tasks_in_flight": _unfinished(send),
        "metadata_in_flight": len(shared), "metadata_bytes": meta_bytes, "outstanding_leases": len(keys),
        "backend_copies_pending": sum(pending) if pending is not None else None,
    }
