"""The Python API: turn tracing on for a set of target classes, and off again.

``start_tracing`` creates the recorder, installs the patch table on the target classes (real
vLLM-Ascend from ``otel_kvtrace.instrument.upstream`` or the replica's look-alikes), and starts the
background exporter. ``TracingSession.shutdown`` uninstruments (every patched attribute is the original
again) and drains what was recorded. Nothing here runs unless called: with tracing off no class is
patched, no thread started, nothing allocated.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing import util as mp_util
from typing import Any

from otel_kvtrace import config, schedule
from otel_kvtrace.instrument import attach, patches
from otel_kvtrace.instrument.runtime import Runtime, default_run_id
from otel_kvtrace.instrument.targets import Targets
from otel_kvtrace.instrument.wrappers import release
from otel_kvtrace.record.recorder import DEFAULT_CAPACITY, Recorder
from otel_kvtrace.record.ring import REASON_SHUTDOWN

logger = logging.getLogger("otel_kvtrace")
MP_EXIT_PRIORITY = 20
"""The session's exit hook runs before the exporter's (priority 10) among multiprocessing finalizers."""




@dataclass(slots=True)
class SessionStats:
    submitted: int  # records handed to the exporter
    dropped: int  # records lost because the exporter fell behind (or a batch failed)
    disabled_reason: str | None  # set when an instrumentation error turned tracing off
    untraced: int = 0  # tasks that were already queued when tracing started (ran untraced)
    delivered: int = 0  # acknowledged by the sink's destination (file written, OTLP receiver answered)
    spooled: int = 0  # on disk in the OTLP delivery spool, not yet acknowledged (`kvtrace resend`)


class TracingSession:
    """One active instrumentation: recorder + installed patches + exporter."""

    def __init__(
        self,
        targets: Targets,
        recorder: Recorder,
        runtime: Runtime,
        installed: list[patches.InstalledPatch],
        exporter: Any,
    ) -> None:
        self.targets = targets
        self.recorder = recorder
        self.runtime = runtime
        self.exporter = exporter
        self._installed = installed
        self._closed = False
        self._untraced = 0  # counted over detached queues too
        self._unlisten: Any = lambda: None  # stops following the scheduler in force
        # At interpreter exit, and at a multiprocessing child's os._exit (before the exporter's own
        # finalizer: higher priority): release records held for a consumer wait (flagged), then drain
        # within the exit deadline (a dying process must not wait out the export timeout).
        atexit.register(self._shutdown_at_exit)
        self._register_mp_exit()
        mp_util.register_after_fork(self, TracingSession._register_mp_exit)

    def _register_mp_exit(self) -> None:
        self._mp_exit = mp_util.Finalize(None, self._shutdown_at_exit, exitpriority=MP_EXIT_PRIORITY)

    @property
    def run_id(self) -> str:
        return self.runtime.run_id

    def uninstrument(self) -> None:
        """Restore every patched class attribute and every replaced per-instance object.

        Records still waiting for the forward's consumer wait are handed to the exporter first, so a
        shutdown mid-step loses nothing that was recorded.
        """
        patches.uninstall(self._installed)
        for worker in self.runtime.workers:
            state = worker.__dict__.get(attach.WORKER_ATTR)
            if state is not None:
                held = list(state.step_records.values())
                state.step_records.clear()
                for rec in held:
                    release(self.runtime, rec, REASON_SHUTDOWN)
        for state in self.runtime.queues:
            self._untraced += state.untraced
            attach.detach(state)
        for worker in self.runtime.workers:
            worker.__dict__.pop(attach.WORKER_ATTR, None)
        self.runtime.queues.clear()
        self.runtime.workers.clear()
        self.runtime.state_by_thread.clear()

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Export everything recorded so far."""
        if self.exporter is None:
            return True
        return bool(self.exporter.force_flush(timeout_s))

    def shutdown(self, timeout_s: float = 10.0) -> SessionStats:
        """Uninstrument, drain and stop the exporter. Idempotent."""
        if self._close():
            self.exporter.shutdown(timeout_s)
        return self.stats()

    def _shutdown_at_exit(self) -> None:
        """The exit drain: the exporter's own at-exit path (``OTEL_KVTRACE_EXIT_DRAIN_MS``, all waits)."""
        if self._close():
            at_exit = getattr(self.exporter, "shutdown_at_exit", None)
            if at_exit is not None:
                at_exit()
            else:
                self.exporter.shutdown(config.exit_drain_s())

    def _close(self) -> bool:
        """Stop recording (once): True when there is an exporter left to shut down."""
        if self._closed:
            return False
        self._closed = True
        with contextlib.suppress(Exception):  # interpreter teardown
            atexit.unregister(self._shutdown_at_exit)
            self._mp_exit.cancel()
        self._unlisten()
        self.uninstrument()
        return self.exporter is not None

    def stats(self) -> SessionStats:
        untraced = self._untraced + sum(state.untraced for state in self.runtime.queues)
        export_stats = getattr(self.exporter, "stats", None)
        if export_stats is None:  # no exporter (tests drain the recorder themselves)
            return SessionStats(self.recorder.submitted, self.recorder.dropped, self.recorder.disabled_reason, untraced)
        e = export_stats()
        return SessionStats(self.recorder.submitted, e.dropped, self.recorder.disabled_reason, untraced,
                            e.delivered, e.spooled)

    def __enter__(self) -> TracingSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def start_tracing(
    targets: Targets | Mapping[str, Any],
    *,
    resource: Mapping[str, Any] | None = None,
    out_dir: str | os.PathLike[str] | None = None,
    endpoint: str | None = None,
    protocol: str | None = None,
    clock: Callable[[], int] | None = None,
    npu_timing: bool | None = None,
    capacity: int = DEFAULT_CAPACITY,
    run_id: str | None = None,
    exporter: Any = "auto",
    meter_provider: Any = None,
) -> TracingSession:
    """Instrument ``targets`` and start exporting.

    Export goes to OTLP when ``endpoint`` (or ``OTEL_EXPORTER_OTLP[_TRACES]_ENDPOINT``) is set, otherwise
    to OTLP JSON lines under ``out_dir`` (default ``./kvtrace-data``). Pass ``exporter=None`` to record
    without exporting (records stay in ``session.recorder``; tests drain them). ``meter_provider``
    receives the exporter's counters (default: the global one).
    """
    targets = Targets.coerce(targets)
    recorder = Recorder(capacity=capacity, clock=clock if clock is not None else time.perf_counter_ns)
    if npu_timing is None:
        npu_timing = os.environ.get(config.OTEL_KVTRACE_NPU_TIMING, "").strip().lower() in ("1", "true", "yes", "on")
    runtime = Runtime(
        recorder=recorder,
        run_id=run_id or default_run_id(),
        npu_timing_wanted=npu_timing,
        npu_event_class=targets.npu_event_class,
    )
    recorder.npu_resolver = runtime.resolve
    resource_attrs = dict(resource or {})
    resource_attrs.setdefault("kvtrace.run_id", runtime.run_id)
    resource_attrs.setdefault("kvtrace.source", targets.source)
    if targets.version:
        resource_attrs.setdefault("vllm_ascend.version", targets.version)
    since = schedule.threads_seen()  # this session's recv threads, not earlier ones of this process
    resource_attrs.setdefault("kvtrace.cfg.scheduler", schedule.scheduler_in_force())
    # The exporter first: with the agent, records must find the ring attached from the first task on.
    export_worker = exporter
    if exporter in ("auto", config.EXPORTER_AGENT, config.EXPORTER_THREAD):
        mode = config.exporter_mode() if exporter == "auto" else exporter
        if mode == config.EXPORTER_AGENT:
            from otel_kvtrace.export.agent_link import create_agent_exporter

            export_worker = create_agent_exporter(
                recorder, resource_attrs, out_dir=out_dir, endpoint=endpoint, protocol=protocol,
                meter_provider=meter_provider,
            )
        else:
            from otel_kvtrace.export import create_exporter  # deferred: pulls in the OTel SDK

            export_worker = create_exporter(
                recorder, resource_attrs, out_dir=out_dir, endpoint=endpoint, protocol=protocol,
                meter_provider=meter_provider,
            )
    installed = patches.install(targets, runtime)
    if not installed:
        if export_worker is not None:
            export_worker.shutdown(1.0)
        raise RuntimeError(
            "these classes are already instrumented by another tracing session; "
            "shut it down (session.shutdown()) before starting a new one"
        )
    session = TracingSession(targets, recorder, runtime, installed, export_worker)
    if hasattr(export_worker, "update_resource"):  # the recv queues' policy as it changes (attach, switch)
        session._unlisten = schedule.add_listener(
            lambda: export_worker.update_resource({"kvtrace.cfg.scheduler": schedule.scheduler_in_force(since)}))
    return session
