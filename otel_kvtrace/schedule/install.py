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
"""Names that run live. ``gate_group`` merges several layers into one backend call, which upstream's
one-layer ``_handle_request`` cannot express without rewriting it: it is predicted by the what-if only."""

_lock = threading.Lock()
_active = "fifo"
_installed: list[patches.InstalledPatch] = []
_queues: weakref.WeakSet[SchedulingQueue] = weakref.WeakSet()


def check_scheduler(name: str) -> str:
    """The live policy called ``name``; ValueError (one clear sentence) for anything else."""
    key = (name or "").strip().lower()
    if key in LIVE:
        return key
    if key in SCHEDULERS:
        raise ValueError(f"scheduler {key!r} is predicted by `kvtrace whatif` only, it cannot run live; "
                         f"choose from {', '.join(LIVE)}")
    raise ValueError(f"scheduler: unknown {name!r}; choose from {', '.join(LIVE)}")


def from_env(environ: Mapping[str, str] | None = None) -> str:
    """``OTEL_KVTRACE_SCHEDULER`` (unset = ``fifo``); a bad value logs one warning and gives ``fifo``."""
    env = os.environ if environ is None else environ
    raw = env.get(config.OTEL_KVTRACE_SCHEDULER, "").strip()
    if not raw:
        return "fifo"
    try:
        return check_scheduler(raw)
    except ValueError as exc:
        logger.warning("otel-kvtrace: %s=%s ignored, recv thread stays fifo: %s", config.OTEL_KVTRACE_SCHEDULER,
                       raw, exc)
        return "fifo"


def active_scheduler() -> str:
    """The policy new recv threads get (what goes on the trace resource as ``kvtrace.cfg.scheduler``)."""
    return _active


def attach(thread: Any, name: str) -> SchedulingQueue | None:
    """Give one not-yet-started recv thread the scheduler ``name``; None when it stays FIFO (logged)."""
    name = check_scheduler(name)
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
    q = SchedulingQueue(thread, name)
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
    removes the patch, and running threads switch to FIFO at their next ``get()`` (drains safely)."""
    global _active
    name = check_scheduler(name)
    with _lock:
        _active = name
        if name == "fifo":
            patches.uninstall(_installed)
        elif not _installed:
            _installed.extend(patches.install(Targets.coerce(targets), None, POINTS))  # type: ignore[arg-type]
        for q in list(_queues):
            q.set_policy(name)
    return name


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
