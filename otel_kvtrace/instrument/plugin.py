"""Auto-enable in every vLLM process: the ``vllm.general_plugins`` entry point.

vLLM calls every general plugin in each process it starts (engine core, every worker), sometimes more
than once. ``register`` therefore does nothing unless ``OTEL_KVTRACE_ENABLED=1``, binds at most once per
process, and never lets an exception reach vLLM: a failure to bind logs one warning and leaves the host
untouched. The ``opentelemetry_instrumentor`` entry point (:mod:`.instrumentor`) shares the same
per-process session, so enabling both does not instrument twice.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys
import threading
import types
from collections.abc import Mapping
from typing import Any

from otel_kvtrace import config
from otel_kvtrace.instrument.targets import Targets

logger = logging.getLogger("otel_kvtrace")

ENV_ENABLED = config.OTEL_KVTRACE_ENABLED

_lock = threading.Lock()
_session: Any = None  # the process's TracingSession, once started
_attempted = False  # a failed attempt is not retried on every plugin call


def enabled() -> bool:
    """True when ``OTEL_KVTRACE_ENABLED`` is set to a true value (``1``, ``true``, ``yes``, ``on``)."""
    return config.tracing_enabled()


def upstream_resource(targets: Targets) -> dict[str, Any]:
    """Per-process resource attributes known before any worker exists (ranks come per queue)."""
    return {"kvtrace.source": targets.source, "vllm_ascend.version": targets.version or "unknown"}


def ensure_started(
    targets: Targets | None = None,
    *,
    resource: Mapping[str, Any] | None = None,
    **start_kwargs: Any,
) -> Any:
    """Start this process's tracing session once; later calls return it. Returns None on failure.

    Without ``targets`` the installed vLLM-Ascend is bound (:func:`.upstream.resolve_installed`); tracing
    stays off, with a warning, when a required patch point is missing.
    """
    global _session, _attempted
    with _lock:
        if _session is not None or _attempted:
            return _session
        _attempted = True
        try:
            if config.sdk_disabled():
                logger.info("otel-kvtrace: OTEL_SDK_DISABLED=true, tracing stays off (nothing patched)")
                return None
            if targets is None:
                from otel_kvtrace.instrument.upstream import resolve_installed

                binding = resolve_installed()
                if not binding.ok:
                    missing = ", ".join(f"{p.point.id} ({p.where})" for p in binding.missing_required())
                    logger.warning("otel-kvtrace: tracing off, vLLM-Ascend %s lacks required patch points: %s "
                                   "(run `kvtrace doctor`)", binding.version, missing)
                    return None
                targets = binding.to_targets()
            from otel_kvtrace.api import start_tracing

            attrs = upstream_resource(targets)
            attrs.update(resource or {})
            _session = start_tracing(targets, resource=attrs, **start_kwargs)
            _session.runtime.on_worker_attached.append(_worker_resource_updater(_session, targets))
            logger.info("otel-kvtrace: tracing vLLM-Ascend %s (pid %d)", targets.version, os.getpid())
        except Exception as exc:  # never break the host process
            logger.warning("otel-kvtrace: tracing off, could not instrument: %s: %s", type(exc).__name__, exc)
            _session = None
        return _session


def _worker_resource_updater(session: Any, targets: Targets) -> Any:
    """Once a worker starts its transfer threads, its ranks and layerwise config join the resource."""
    from otel_kvtrace.instrument.upstream import worker_resource_attributes

    layout = str(targets.flags.get("layout", "") or "")

    def update(worker: Any) -> None:
        if session.exporter is not None and hasattr(session.exporter, "update_resource"):
            session.exporter.update_resource(worker_resource_attributes(worker, layout))

    return update


def stop() -> None:
    """Shut the process's session down (uninstrument + flush) and allow a new start."""
    global _session, _attempted
    _remove_hook()
    from otel_kvtrace.asynccheck.instrument import uninstall_active

    uninstall_active()  # the engine-loop part register() turned on
    with _lock:
        session, _session, _attempted = _session, None, False
    if session is not None:
        try:
            session.shutdown()
        except Exception as exc:
            logger.warning("otel-kvtrace: shutdown failed: %s: %s", type(exc).__name__, exc)


def current_session() -> Any:
    return _session


#: Importing this module means the process is a KV-pool worker: the moment to bind.
WATCHED_MODULE = "vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.pool_worker"


class _DelegatingLoader(importlib.abc.Loader):
    """Runs the real loader, then ``after()``; used once, for ``WATCHED_MODULE``."""

    def __init__(self, inner: importlib.abc.Loader, after: Any) -> None:
        self._inner = inner
        self._after = after

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._inner.exec_module(module)
        self._after()

    def __getattr__(self, name: str) -> Any:  # get_code, get_source, ... for tracebacks and tools
        return getattr(self._inner, name)


class _BindOnImport(importlib.abc.MetaPathFinder):
    """Binds right after vLLM itself imports the KV-pool worker module, never earlier.

    Importing vLLM-Ascend's KV pool from the plugin hook would run its imports in every vLLM process
    (API server, engine core) and possibly before vLLM-Ascend's own set-up; waiting for vLLM to import
    it keeps the plugin free of side effects until the worker exists.
    """

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != WATCHED_MODULE:
            return None
        _remove_hook()
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _DelegatingLoader(spec.loader, ensure_started)
        return spec


_hook: _BindOnImport | None = None


def _importable(name: str) -> bool:
    if name in sys.modules:
        return True
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _install_hook() -> None:
    global _hook
    if _hook is None:
        _hook = _BindOnImport()
        sys.meta_path.insert(0, _hook)


def _remove_hook() -> None:
    global _hook
    if _hook is not None:
        try:
            sys.meta_path.remove(_hook)
        except ValueError:
            pass
        _hook = None


def _log_kv_pool_off(engine_loop_on: bool) -> None:
    """Plain vLLM: say once what is on. Only a process with nothing traced gets a warning."""
    global _attempted
    _attempted = True
    if engine_loop_on:
        logger.info("otel-kvtrace: KV-pool tracing off (vllm_ascend is not importable); engine-loop "
                    "(async-scheduling) tracing is on (pid %d)", os.getpid())
    else:
        logger.warning("otel-kvtrace: tracing off: vllm_ascend is not importable (no KV-pool tracing) and "
                       "engine-loop tracing is off (vLLM not importable, or OTEL_KVTRACE_ASYNC=0)")


def register() -> None:
    """vLLM general-plugin hook: instrument this process when ``OTEL_KVTRACE_ENABLED=1``.

    Binds now if vLLM-Ascend's KV-pool worker module is already imported, otherwise right after vLLM
    imports it (processes that never do, like the API server, stay untouched). Idempotent and
    exception-free, as vLLM may call it several times per process. The async-scheduling engine-loop
    spans (``otel_kvtrace.asynccheck``) are switched on here too (``OTEL_KVTRACE_ASYNC=0`` keeps them off).
    """
    try:
        if not enabled():
            return
        from otel_kvtrace.asynccheck.instrument import install_from_env

        engine_loop = install_from_env()  # idempotent, never raises, no-op without vllm; logs when on
        if _session is not None or _attempted:
            return
        if WATCHED_MODULE in sys.modules:
            ensure_started()
        elif not _importable("vllm_ascend"):
            _log_kv_pool_off(engine_loop is not None)
        else:
            _install_hook()
    except Exception as exc:  # never break vLLM's plugin loading
        logger.warning("otel-kvtrace: plugin registration failed: %s: %s", type(exc).__name__, exc)
