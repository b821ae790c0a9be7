"""``KVTraceInstrumentor``: the OpenTelemetry ``BaseInstrumentor`` face of otel-kvtrace.

``opentelemetry-instrument`` finds it through the ``opentelemetry_instrumentor`` entry point and calls
``instrument()`` with no arguments; that must do the same as a plain call, so both follow
``OTEL_KVTRACE_ENABLED`` (off by default). Pass ``enabled=True`` to force it on, or ``targets=`` to
instrument specific classes (the replica's, or a :class:`~.upstream.UpstreamBinding`'s). The session is
the one :mod:`.plugin` keeps per process, so the vLLM plugin and this instrumentor never double-patch.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from opentelemetry.instrumentation.instrumentor import BaseInstrumentor  # type: ignore[attr-defined]

from otel_kvtrace.instrument import plugin
from otel_kvtrace.instrument.targets import Targets

_INSTRUMENTS: tuple[str, ...] = ()
"""No pip-level requirement: the binding checks the actual classes (see ``kvtrace doctor``)."""


class KVTraceInstrumentor(BaseInstrumentor):  # type: ignore[misc]
    """Instrument vLLM-Ascend's layerwise KV recv pipeline (or given target classes).

    Example::

        from otel_kvtrace.instrument.instrumentor import KVTraceInstrumentor
        KVTraceInstrumentor().instrument(enabled=True, out_dir="./kvtrace-data")
        ...
        KVTraceInstrumentor().uninstrument()
    """

    def instrumentation_dependencies(self) -> Collection[str]:
        return _INSTRUMENTS

    def _instrument(self, **kwargs: Any) -> None:
        targets = kwargs.pop("targets", None)
        force = kwargs.pop("enabled", None)
        if force is False or (force is None and targets is None and not plugin.enabled()):
            return
        if targets is not None and not isinstance(targets, Targets):
            to_targets = getattr(targets, "to_targets", None)  # an UpstreamBinding
            targets = to_targets() if to_targets is not None else Targets.coerce(targets)
        plugin.ensure_started(targets, **kwargs)

    def _uninstrument(self, **kwargs: Any) -> None:
        plugin.stop()

    @property
    def session(self) -> Any:
        """The active tracing session (None when off or when binding failed)."""
        return plugin.current_session()
