"""What one resource sample reads, from a ``KVPoolWorker`` (upstream-shaped: the replica's or vLLM-Ascend's).

Every read is an attribute read or a ``queue.Queue`` counter: nothing locks the transfer threads' queues,
nothing touches the NPU stream (torch_npu's ``memory_allocated`` / ``max_memory_allocated`` /
``memory_reserved`` read the caching allocator's counters and do not synchronise). Definitions:

- ``tasks_in_flight``: ``kv_recv_thread.request_queue.unfinished_tasks`` (queued + being handled);
  ``save_tasks_in_flight`` the same for ``kv_send_thread``;
- ``metadata_in_flight`` / ``metadata_bytes``: distinct ``SharedBlockData`` objects referenced by the
  queued load tasks, and the bytes of their ``block_ids_arr`` (``nbytes`` of a numpy array, else 8 per
  entry): the address arrays built for tasks that have not run yet;
- ``outstanding_leases``: distinct ``load_keys`` of the queued tasks and of the task the recv thread is
  running (leases are removed only after the final layer's copy, ``batch_remove_lease``, so the final
  layer's task holds them while it runs). The running task is the last one that left the queue while
  ``unfinished_tasks`` counts more than the queue holds (``WorkerProbe`` remembers the previous poll);
- when nothing is queued or running the poll reads two counters and copies nothing;
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
    """The in-flight counters from the queue alone (one poll, no memory of the previous one)."""
    return WorkerProbe(worker)()


class WorkerProbe:
    """The in-flight counters of one worker, polled by the sampler thread (attribute reads only)."""

    __slots__ = ("_worker", "_prev", "_running")

    def __init__(self, worker: Any) -> None:
        self._worker = worker
        self._prev: list[Any] = []
        self._running: Any = None

    def __call__(self) -> dict[str, int | None]:
        worker = self._worker
        recv, send = getattr(worker, "kv_recv_thread", None), getattr(worker, "kv_send_thread", None)
        unfinished = _unfinished(recv)
        store = getattr(getattr(worker, "m_store", None), "store", None)
        pending = getattr(store, "pending_copies", None)
        out: dict[str, int | None] = {
            "tasks_in_flight": unfinished, "save_tasks_in_flight": _unfinished(send),
            "backend_copies_pending": sum(pending) if pending is not None else None,
            "metadata_in_flight": 0, "metadata_bytes": 0, "outstanding_leases": 0}
        if not unfinished:  # idle: nothing queued, nothing running
            self._prev, self._running = [], None
            return out
        queued = _queued(recv)
        if unfinished > len(queued):  # one task is being handled: the last one that left the queue
            ids = {id(t) for t in queued}
            left = [t for t in self._prev if id(t) not in ids]
            if left:
                self._running = left[-1]
        else:
            self._running = None
        self._prev = queued
        shared = _shared_data([*queued, self._running] if self._running is not None else queued)
        meta_bytes, keys = 0, set()
        for data in shared.values():
            arr = getattr(data, "block_ids_arr", None)
            if arr is not None:
                meta_bytes += int(getattr(arr, "nbytes", len(arr) * 8))
            keys.update(getattr(data, "load_keys", None) or ())
        out.update(metadata_in_flight=len(shared), metadata_bytes=meta_bytes, outstanding_leases=len(keys))
        return out


def _shared_data(tasks: list[Any]) -> dict[int, Any]:
    shared: dict[int, Any] = {}
    for task in tasks:
        for tt in getattr(task, "transfer_tasks", None) or ():
            data = getattr(tt, "shared_block_data", None)
            if data is not None:
                shared[id(data)] = data
    return shared
