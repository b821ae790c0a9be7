"""Auto-enable in every vLLM process: the ``vllm.general_plugins`` entry point.

vLLM calls every general plugin in each process it starts (engine core, every worker), sometimes more
than once. ``register`` therefore does nothing unless ``OTEL_KVTRACE_ENABLED=1`` and never lets an
exception reach vLLM. It only decides *when* to bind; *what* binding means is
:class:`~.instrumentor.KVTraceInstrumentor`'s (the one composition root), whose per-process
idempotence also covers the ``opentelemetry_instrumentor`` entry point: enabling both instruments once.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys
import types
from collections.abc import Mapping
from typing import Any

from otel_kvtrace import config
from otel_kvtrace.instrument.targets import Targets

logger = logging.getLogger("otel_kvtrace")

ENV_ENABLED = config.OTEL_KVTRACE_ENABLED


def _instrumentor() -> Any:
    """The process's ``KVTraceInstrumentor`` (imported on first use: a disabled plugin imports nothing)."""
    from otel_kvtrace.instrument.instrumentor import KVTraceInstrumentor

    return KVTraceInstrumentor()


def enabled() -> bool:
    """True when ``OTEL_KVTRACE_ENABLED`` is set to a true value (``1``, ``true``, ``yes``, ``on``)."""
    return config.tracing_enabled()


def ensure_started(
    targets: Targets | None = None,
    *,
    resource: Mapping[str, Any] | None = None,
    **start_kwargs: Any,
) -> Any:
    """Instrument this process once (``KVTraceInstrumentor``); later calls return the same session.

    Returns None when tracing is off (``KVTraceInstrumentor().off_reason`` says why).
    """
    instrumentor = _instrumentor()
    if not instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.instrument(enabled=True, targets=targets, resource=resource, **start_kwargs)
    return instrumentor.session


def stop() -> None:
    """Shut the process's session down (uninstrument + flush) and allow a new start."""
    _remove_hook()
    from otel_kvtrace.asynccheck.instrument import uninstall_active

    uninstall_active()  # the engine-loop part register() turned on
    global _kv_pool_off_logged
    _kv_pool_off_logged = False
    instrumentor = _instrumentor()
    if instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.uninstrument()


def current_session() -> Any:
    return _instrumentor().session


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
        self._inner.exec_module(module)  # upstream's own import errors propagate unchanged
        try:
            self._after()
        except Exception as exc:  # noqa: BLE001 - never break vLLM's import of its worker module
            logger.warning("otel-kvtrace: binding to %s failed, tracing off: %s: %s",
                           module.__name__, type(exc).__name__, exc)

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
            spec.loader = _DelegatingLoader(spec.loader, _bind)
        return spec


_hook: _BindOnImport | None = None


def _bind() -> None:
    """The worker module is imported: the recv scheduler (``OTEL_KVTRACE_SCHEDULER``, tracing on or
    off; never raises), then tracing when it is on."""
    from otel_kvtrace.schedule.install import bind_installed

    bind_installed()
    if enabled():
        ensure_started()


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


_kv_pool_off_logged = False
"""Logging once only (plain vLLM calls ``register`` in every process, sometimes several times)."""


def log_kv_pool_off(engine_loop_on: bool) -> None:
    """Plain vLLM (no vLLM-Ascend): say once what is on. Only a process with nothing traced gets a warning.
    The one message for the plugin and ``KVTraceInstrumentor``."""
    global _kv_pool_off_logged
    if _kv_pool_off_logged:
        return
    _kv_pool_off_logged = True
    if engine_loop_on:
        logger.info("otel-kvtrace: KV-pool tracing off (vllm_ascend is not importable); engine-loop "
                    "(async-scheduling) tracing is on (pid %d)", os.getpid())
    else:
        logger.warning("otel-kvtrace: tracing off: vllm_ascend is not importable (no KV-pool tracing) and "
                       "engine-loop tracing is off (vLLM not importable, or OTEL_KVTRACE_ASYNC=0); see `kvtrace doctor`")


def register() -> None:
    """vLLM general-plugin hook: instrument this process when ``OTEL_KVTRACE_ENABLED=1``.

    Binds now if vLLM-Ascend's KV-pool worker module is already imported, otherwise right after vLLM
    imports it (processes that never do, like the API server, stay untouched). Idempotent and
    exception-free, as vLLM may call it several times per process. The async-scheduling engine-loop
    spans (``otel_kvtrace.asynccheck``) are switched on here too (``OTEL_KVTRACE_ASYNC=0`` keeps them off).
    """
    try:
        if not enabled():
            from otel_kvtrace.schedule.install import requested

            if requested() and WATCHED_MODULE in sys.modules:  # the scheduler alone, tracing off
                _bind()
            elif requested():
                _install_hook()
            return
        from otel_kvtrace.asynccheck.instrument import install_from_env

        engine_loop = install_from_env()  # idempotent, never raises, no-op without vllm; logs when on
        if _instrumentor().is_instrumented_by_opentelemetry:
            return
        if WATCHED_MODULE in sys.modules:
            _bind()
        elif not _importable("vllm_ascend"):
            log_kv_pool_off(engine_loop is not None)
        else:
            _install_hook()
    except Exception as exc:  # never break vLLM's plugin loading
        logger.warning("otel-kvtrace: plugin registration failed: %s: %s", type(exc).__name__, exc)
