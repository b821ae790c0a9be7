"""``KVTraceInstrumentor``: the one composition root of otel-kvtrace in a process.

Every way of switching tracing on ends here: ``opentelemetry-instrument`` (the
``opentelemetry_instrumentor`` entry point calls ``instrument()`` with no arguments), the vLLM plugin
(:mod:`.plugin`, ``vllm.general_plugins``), and a direct call. It resolves the targets (the installed
vLLM-Ascend by default), starts the session (:func:`otel_kvtrace.api.start_tracing`) and wires the
per-worker resource update. Idempotence is ``BaseInstrumentor``'s: the instrumentor is a per-process
singleton, and ``instrument()`` after a first call is a no-op until ``uninstrument()``.

A call that cannot work raises (an unknown keyword, a bad value: checked by :func:`check_options`
before anything is touched); everything after that never raises: a process that cannot be traced
(vLLM-Ascend missing or lacking a required patch point, ``OTEL_SDK_DISABLED``, a bad
``OTEL_EXPORTER_OTLP_*`` setting, a bug of ours) logs once, stays untouched, and says why in
``off_reason``. The vLLM plugin runs this inside vLLM's import of the KV-pool worker module.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Collection, Mapping
from typing import Any

from opentelemetry.instrumentation.instrumentor import BaseInstrumentor  # type: ignore[attr-defined]

from otel_kvtrace import config
from otel_kvtrace.instrument.targets import Targets

logger = logging.getLogger("otel_kvtrace")

_INSTRUMENTS: tuple[str, ...] = ()
"""No pip-level requirement: the binding checks the actual classes (see ``kvtrace doctor``)."""


def _start_tracing_options() -> frozenset[str]:
    from otel_kvtrace.api import start_tracing

    return frozenset(p for p in inspect.signature(start_tracing).parameters if p != "targets")


def check_options(options: Mapping[str, Any]) -> None:
    """Raise ``TypeError``/``ValueError`` for keywords the caller got wrong (unknown names, values of the
    wrong kind); checked before anything is patched or started."""
    unknown = set(options) - _start_tracing_options()
    if unknown:
        raise TypeError(f"KVTraceInstrumentor.instrument() got unknown keyword(s): {', '.join(sorted(unknown))}")
    protocol = options.get("protocol")
    if protocol is not None and protocol not in config.PROTOCOLS:
        raise ValueError(f"protocol must be one of {', '.join(config.PROTOCOLS)}, got {protocol!r}")
    capacity = options.get("capacity")
    if capacity is not None and (not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1):
        raise ValueError(f"capacity must be an int >= 1, got {capacity!r}")
    resource = options.get("resource")
    if resource is not None and not isinstance(resource, Mapping):
        raise TypeError(f"resource must be a mapping of attributes, got {type(resource).__name__}")
    for name in ("endpoint", "run_id"):
        value = options.get(name)
        if value is not None and not isinstance(value, str):
            raise TypeError(f"{name} must be a str, got {type(value).__name__}")


def upstream_resource(targets: Targets) -> dict[str, Any]:
    """Per-process resource attributes known before any worker exists (ranks come per queue)."""
    from otel_kvtrace.schedule import scheduler_in_force

    return {"kvtrace.source": targets.source, "vllm_ascend.version": targets.version or "unknown",
            "kvtrace.cfg.scheduler": scheduler_in_force()}


def provider_resource(tracer_provider: Any) -> dict[str, Any]:
    """The application's resource from its SDK ``TracerProvider`` (empty for the API's no-op/proxy)."""
    resource = getattr(tracer_provider, "resource", None)
    attributes = getattr(resource, "attributes", None)
    return dict(attributes) if isinstance(attributes, Mapping) else {}


class KVTraceInstrumentor(BaseInstrumentor):  # type: ignore[misc]
    """Instrument vLLM-Ascend's layerwise KV recv pipeline (or given target classes).

    Keywords: ``enabled`` (True forces tracing on, False off; default ``OTEL_KVTRACE_ENABLED``, or on
    when ``targets`` are given), ``targets`` (``Targets``, a class mapping, or an ``UpstreamBinding``),
    ``tracer_provider`` (its resource joins the spans' resource; spans are exported by kvtrace's own
    exporter, configured by the ``OTEL_EXPORTER_OTLP_*`` variables), ``meter_provider`` (for the
    exporter's counters), and every keyword of :func:`otel_kvtrace.api.start_tracing`.

    Example::

        from otel_kvtrace.instrument.instrumentor import KVTraceInstrumentor
        KVTraceInstrumentor().instrument(enabled=True, out_dir="./kvtrace-data")
        ...
        KVTraceInstrumentor().uninstrument()
    """

    _session: Any = None
    off_reason: str | None = None

    def instrumentation_dependencies(self) -> Collection[str]:
        return _INSTRUMENTS

    def _instrument(self, **kwargs: Any) -> None:
        targets = kwargs.pop("targets", None)
        force = kwargs.pop("enabled", None)
        tracer_provider = kwargs.pop("tracer_provider", None)
        check_options(kwargs)  # raised, so BaseInstrumentor does not mark the process instrumented
        self._session, self.off_reason = None, None
        if force is False or (force is None and targets is None and not config.tracing_enabled()):
            self.off_reason = f"{config.OTEL_KVTRACE_ENABLED} is not set" if force is None else "enabled=False"
            return
        if config.sdk_disabled():
            self.off_reason = "OTEL_SDK_DISABLED=true"
            logger.info("otel-kvtrace: OTEL_SDK_DISABLED=true, tracing stays off (nothing patched)")
            return
        try:
            targets = self._resolve(targets)
            if targets is None:
                return
            self._session = self._start(targets, tracer_provider, kwargs)
        except Exception as exc:  # noqa: BLE001 - never break the host process (the call itself was checked)
            self._session = None
            self.off_reason = f"{type(exc).__name__}: {exc}"
            from otel_kvtrace.instrument.upstream import UpstreamNotFound

            if isinstance(exc, UpstreamNotFound):  # plain vLLM: say what is on (one message, logged once)
                from otel_kvtrace.asynccheck.instrument import active as engine_loop_active
                from otel_kvtrace.instrument.plugin import log_kv_pool_off

                log_kv_pool_off(engine_loop_active())
            else:
                logger.warning("otel-kvtrace: tracing off, could not instrument: %s", self.off_reason)

    def _resolve(self, targets: Any) -> Targets | None:
        if targets is None:
            from otel_kvtrace.instrument.upstream import resolve_installed

            binding = resolve_installed()
            if not binding.ok:
                missing = ", ".join(f"{p.point.id} ({p.where})" for p in binding.missing_required())
                self.off_reason = f"vLLM-Ascend {binding.version} lacks required patch points: {missing}"
                logger.warning("otel-kvtrace: tracing off, %s (run `kvtrace doctor`)", self.off_reason)
                return None
            return binding.to_targets()
        if isinstance(targets, Targets):
            return targets
        to_targets = getattr(targets, "to_targets", None)  # an UpstreamBinding
        return to_targets() if to_targets is not None else Targets.coerce(targets)

    def _start(self, targets: Targets, tracer_provider: Any, options: dict[str, Any]) -> Any:
        from otel_kvtrace.api import start_tracing

        resource = provider_resource(tracer_provider)
        resource.update(upstream_resource(targets))
        resource.update(options.pop("resource", None) or {})
        session = start_tracing(targets, resource=resource, **options)
        session.runtime.on_worker_attached.append(_worker_resource_updater(session, targets))
        self._samplers: list[Any] = []
        session.runtime.on_worker_attached.append(_worker_sampler(session, options, self._samplers))
        logger.info("otel-kvtrace: tracing %s %s (pid %d)", targets.source, targets.version or "", os.getpid())
        return session

    def _uninstrument(self, **kwargs: Any) -> None:
        session, self._session, self.off_reason = self._session, None, None
        for sampler in getattr(self, "_samplers", ()):
            try:
                sampler.stop()
            except Exception as exc:  # noqa: BLE001
                logger.warning("otel-kvtrace: resource sampler stop failed: %s: %s", type(exc).__name__, exc)
        self._samplers = []
        if session is not None:
            try:
                session.shutdown()
            except Exception as exc:  # noqa: BLE001
                logger.warning("otel-kvtrace: shutdown failed: %s: %s", type(exc).__name__, exc)

    @property
    def session(self) -> Any:
        """The active tracing session (None when off; ``off_reason`` says why)."""
        return self._session


def _worker_resource_updater(session: Any, targets: Targets) -> Any:
    """Once a worker starts its transfer threads, its ranks and layerwise config join the resource."""
    from otel_kvtrace.instrument.upstream import worker_resource_attributes

    layout = str(targets.flags.get("layout", "") or "")

    def update(worker: Any) -> None:
        if session.exporter is not None and hasattr(session.exporter, "update_resource"):
            session.exporter.update_resource(worker_resource_attributes(worker, layout))

    return update


def _worker_sampler(session: Any, options: dict[str, Any], samplers: list[Any]) -> Any:
    """Once a worker is attached, its resource series (``otel_kvtrace.resources``) runs next to the traces:
    same data dir, run id, meter provider and OTLP endpoint; the step is the worker's traced step counter."""

    def start(worker: Any) -> None:
        try:
            from otel_kvtrace.instrument import attach
            from otel_kvtrace.resources.sampler import ResourceSampler

            ws = attach.worker_state(worker, session.runtime)
            samplers.append(ResourceSampler(
                worker, options.get("out_dir") or config.data_dir(), session.run_id,
                step_source=lambda: ws.step, meter_provider=options.get("meter_provider"),
                endpoint=options.get("endpoint"), protocol=options.get("protocol"),
                attributes={"kvtrace.source": session.targets.source}).start())
        except Exception as exc:  # noqa: BLE001 - the resource series is optional; tracing goes on
            logger.warning("otel-kvtrace: resource sampler off: %s: %s", type(exc).__name__, exc)

    return start
