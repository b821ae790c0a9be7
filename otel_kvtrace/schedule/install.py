"""Switching the live scheduler on and off: ``OTEL_KVTRACE_SCHEDULER``, the Python API, the rollback.

The only patch is one entry through the project's patch mechanism (:mod:`otel_kvtrace.instrument.patches`):
the recv thread classes' ``__init__`` is wrapped so each new GVA recv thread gets a
:class:`~otel_kvtrace.schedule.queue.SchedulingQueue` as its ``request_queue`` before ``start()``.
``fifo`` patches nothing. The key path (``KVCacheStoreKeyLayerRecvingThread``) stays FIFO and logs why.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from otel_kvtrace import config
from otel_kvtrace.instrument import patches
from otel_kvtrace.instrument.points import PatchPoint
from otel_kvtrace.instrument.targets import Targets
from otel_kvtrace.schedule.queue import SchedulingQueue, hook_save_signals, unreadable_waiter

logger = logging.getLogger("otel_kvtrace")

SCHEDULERS = ("fifo", "ready_queue", "gate_group")
"""Names the switch knows (the what-if policies)."""
LIVE = ("fifo", "ready_queue")
"""Names that run live on vLLM-Ascend's recv threads. ``gate_group`` merges several layers into one
backend call, which upstream's one-layer ``_handle_request`` cannot express without rewriting it: there
it is predicted by the what-if only."""
MERGED_LIVE = (*LIVE, "gate_group")
"""Names that run live on a recv thread that can make the merged backend call (the threaded replica's
GVA thread, whose class says ``kvtrace_merged_copy = True``)."""

_lock = threading.Lock()
_active = "fifo"
_installed: list[patches.InstalledPatch] = []
_queues: weakref.WeakSet[SchedulingQueue] = weakref.WeakSet()
_threads: weakref.WeakKeyDictionary[Any, tuple[int, SchedulingQueue | None]] = weakref.WeakKeyDictionary()
"""Every recv thread the patch saw: ``(seq, its scheduler queue or None when it stays FIFO)``."""
_seen = 0
_listeners: list[Callable[[], None]] = []


def check_scheduler(name: str, *, merged_copy: bool = False) -> str:
    """The live policy called ``name``; ValueError (one clear sentence) for anything else.
    ``merged_copy``: the recv thread can copy several layers in one backend call (``gate_group``)."""
    key = (name or "").strip().lower()
    live = MERGED_LIVE if merged_copy else LIVE
    if key in live:
        return key
    if key == "gate_group":
        raise ValueError("scheduler 'gate_group' cannot run on vLLM-Ascend's recv threads: it copies the layers "
                         "of one gate in one backend call, which upstream's one-layer _handle_request cannot "
                         "express; it runs live on the threaded replica only (`kvtrace demo --scheduler "
                         f"gate_group`) and is predicted by `kvtrace whatif`; choose from {', '.join(live)}")
    if key in SCHEDULERS:
        raise ValueError(f"scheduler {key!r} is predicted by `kvtrace whatif` only, it cannot run live; "
                         f"choose from {', '.join(live)}")
    raise ValueError(f"scheduler: unknown {name!r}; choose from {', '.join(live)}")


def from_env(environ: Mapping[str, str] | None = None, *, merged_copy: bool = False) -> str:
    """``OTEL_KVTRACE_SCHEDULER`` (unset = ``fifo``); a bad value logs one warning and gives ``fifo``.
    ``merged_copy``: for the threaded replica, which can run ``gate_group``."""
    env = os.environ if environ is None else environ
    raw = env.get(config.OTEL_KVTRACE_SCHEDULER, "").strip()
    if not raw:
        return "fifo"
    try:
        return check_scheduler(raw, merged_copy=merged_copy)
    except ValueError as exc:
        logger.warning("otel-kvtrace: %s=%s ignored, recv thread stays fifo: %s", config.OTEL_KVTRACE_SCHEDULER,
                       raw, exc)
        return "fifo"


def active_scheduler() -> str:
    """The policy new recv threads get (what the switch asks for; see :func:`scheduler_in_force`)."""
    return _active


def threads_seen() -> int:
    """How many recv threads were attached (or kept FIFO) so far: a session's ``since``."""
    return _seen


def scheduler_in_force(since: int = 0) -> str:
    """``kvtrace.cfg.scheduler``: the policy the recv queues really run (``fifo`` for the key path, an
    unreadable slot waiter, after a fallback or a switch back); several different ones are joined with
    ``+``. Only live threads count, those attached from ``since`` on when there are any (a session's own);
    before any recv thread exists: the policy new ones get."""
    live = [(seq, q) for t, (seq, q) in list(_threads.items()) if t.ident is None or t.is_alive()]
    own = [q for seq, q in live if seq >= since] or [q for _, q in live]
    seen = {q.policy if q is not None else "fifo" for q in own}
    return "+".join(sorted(seen)) if seen else _active


def add_listener(listener: Callable[[], None]) -> Callable[[], None]:
    """Call ``listener()`` whenever :func:`scheduler_in_force` may have changed; returns the remover."""
    _listeners.append(listener)
    return lambda: _listeners.remove(listener) if listener in _listeners else None


def _changed() -> None:
    for listener in list(_listeners):
        try:
            listener()
        except Exception as exc:  # a resource update never breaks the recv thread
            logger.warning("otel-kvtrace: scheduler listener failed: %s: %s", type(exc).__name__, exc)


def attach(thread: Any, name: str) -> SchedulingQueue | None:
    """Give one not-yet-started recv thread the scheduler ``name``; None when it stays FIFO (logged)."""
    global _seen
    q = _attach(thread, check_scheduler(name, merged_copy=merges(thread)))
    if hasattr(thread, "is_alive"):
        _threads[thread] = (_seen, q)
        _seen += 1
    _changed()
    return q


def _attach(thread: Any, name: str) -> SchedulingQueue | None:
    if name == "fifo":
        return None
    label = type(thread).__name__
    if "KeyLayer" in label or not hasattr(thread, "layer_save_finished_events"):
        logger.info("otel-kvtrace: %s stays fifo: the key path's waits are not checked without blocking "
                    "(scheduler %s applies to the GVA path)", label, name)
        return None
    reason = unreadable_waiter(thread)
    if reason is not None:
        logger.warning("otel-kvtrace: %s stays fifo: %s (scheduler %s not attached)", label, reason, name)
        return None
    if thread.ident is not None or thread.request_queue.qsize():
        logger.warning("otel-kvtrace: %s already running, stays fifo (scheduler %s not attached)", label, name)
        return None
    q = SchedulingQueue(thread, name, on_change=_changed)
    thread.request_queue = q
    hook_save_signals(q, thread.layer_save_finished_events)
    _queues.add(q)
    return q


def _wrap_init(original: Callable, policy: Any) -> Callable:
    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        try:
            attach(self, _active)
        except Exception as exc:  # never break the thread's construction
            logger.warning("otel-kvtrace: scheduler not attached: %s: %s", type(exc).__name__, exc)

    __init__.__kvtrace_wrapped__ = original  # type: ignore[attr-defined]
    return __init__


POINTS = tuple(
    PatchPoint(f"S1{suffix}", role, "__init__", (), False, "scheduler: request_queue is a SchedulingQueue",
               _wrap_init)
    for suffix, role in (("", "recv_gva"), ("k", "recv_key"))
)
"""The scheduler's own table, installed by ``patches.install`` (the key path's row only says it stays FIFO)."""


def install_scheduler(targets: Targets | Mapping[str, Any], name: str) -> str:
    """Run the recv threads created from now on under ``name`` (ValueError if unknown); ``fifo``
    removes the patch, and running threads switch to FIFO at their next ``get()`` (drains safely).
    Running scheduler queues switch at their next ``get()``; ``gate_group`` only where the targets' GVA
    recv class can make the merged call (the replica's), and only on queues whose thread can: any other
    queue keeps its policy (its thread has no merged call to make)."""
    global _active
    coerced = Targets.coerce(targets)
    name = check_scheduler(name, merged_copy=any(merges(cls) for cls in coerced.recv_thread_classes))
    with _lock:
        _active = name
        if name == "fifo":
            patches.uninstall(_installed)
        elif not _installed:
            _installed.extend(patches.install(coerced, None, POINTS))  # type: ignore[arg-type]
        for q in list(_queues):
            if name != "gate_group" or merges(q.thread):
                q.set_policy(name)
    _changed()
    return name


def merges(thread_or_class: Any) -> bool:
    """True when a recv thread (or its class) can copy several layers in one backend call
    (``kvtrace_merged_copy = True``, the threaded replica's GVA thread): the one test for ``gate_group``."""
    return getattr(thread_or_class, "kvtrace_merged_copy", False) is True


def install_from_env(targets: Targets | Mapping[str, Any], environ: Mapping[str, str] | None = None) -> str:
    """The vLLM plugin's one call: ``OTEL_KVTRACE_SCHEDULER`` for these classes; never raises."""
    try:
        return install_scheduler(targets, from_env(environ))
    except Exception as exc:
        logger.warning("otel-kvtrace: scheduler not installed, recv thread stays fifo: %s: %s",
                       type(exc).__name__, exc)
        return "fifo"


def requested(environ: Mapping[str, str] | None = None) -> bool:
    """True when ``OTEL_KVTRACE_SCHEDULER`` asks for anything (even a bad name: it gets its warning)."""
    env = os.environ if environ is None else environ
    return bool(env.get(config.OTEL_KVTRACE_SCHEDULER, "").strip())


def bind_installed() -> str:
    """The vLLM plugin's call once vLLM-Ascend's KV-pool worker is imported: the installed recv classes
    under ``OTEL_KVTRACE_SCHEDULER`` (tracing on or off). Never raises; the policy in force."""
    if not requested():
        return _active
    try:
        from otel_kvtrace.instrument.upstream import resolve_installed

        targets = resolve_installed().to_targets()
    except Exception as exc:
        logger.warning("otel-kvtrace: scheduler not installed, recv thread stays fifo: %s: %s",
                       type(exc).__name__, exc)
        return "fifo"
    name = install_from_env(targets)
    if name != "fifo":
        logger.info("otel-kvtrace: recv scheduler %s (%s=%s)", name, config.OTEL_KVTRACE_SCHEDULER, name)
    return name
