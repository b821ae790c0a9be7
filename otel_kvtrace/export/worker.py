"""The background exporter: drains the recorder on a schedule, builds spans, hands batches to a sink.

Modelled on the SDK's ``BatchProcessor``, with one difference that matters on the hot path: recording
threads never signal this thread (no ``Event.set()``, no lock); it wakes on its own schedule. When the
sink is slow or down, the recorder's bounded hand-off fills and new records are dropped and counted
there; failed batches are counted too. Nothing here ever raises into a host thread.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing import util as mp_util
from pathlib import Path
from typing import Any

from opentelemetry import metrics
from opentelemetry.instrumentation.utils import suppress_instrumentation

from otel_kvtrace import config
from otel_kvtrace.export.delivery import DeliveringSink
from otel_kvtrace.export.sinks import JsonLinesFileSink, NullSink, OtlpGrpcSink, OtlpHttpSink, SpanSink
from otel_kvtrace.export.spans import SpanBuilder
from otel_kvtrace.record.model import TaskRecord
from otel_kvtrace.record.recorder import Recorder

logger = logging.getLogger("otel_kvtrace")

THREAD_NAME = "kvtrace-exporter"
DROPPED_METRIC = "kvtrace.exporter.dropped_records"
DELIVERED_METRIC = "kvtrace.exporter.delivered_records"
SPOOLED_METRIC = "kvtrace.exporter.spooled_records"
DEFAULT_SERVICE_NAME = "kvtrace"
SPOOL_STALL_S = 0.5
"""The final drain into a spool is waited for past the exit deadline while a batch lands this often."""


@dataclass(slots=True, frozen=True)
class ExportStats:
    """Where every recorded task is: ``recorded == delivered + spooled + dropped + pending``, always.

    ``pending`` is what the recorder and the exporter still hold (0 once ``shutdown`` returned);
    ``spooled`` is on disk, waiting for the OTLP endpoint (``kvtrace resend`` sends it later).
    """

    recorded: int
    delivered: int
    spooled: int
    dropped: int
    pending: int

    @property
    def balanced(self) -> bool:
        return self.recorded == self.delivered + self.spooled + self.dropped + self.pending

    def line(self) -> str:
        return (f"recorded={self.recorded} delivered={self.delivered} spooled={self.spooled} "
                f"dropped={self.dropped} pending={self.pending}")


class BackgroundExporter:
    """Owns the ``kvtrace-exporter`` daemon thread that turns recorded tasks into exported spans.

    Example::

        recorder = Recorder()
        exporter = BackgroundExporter(recorder, JsonLinesFileSink("./kvtrace-data", "run1", resource))
        ...  # instrumented threads call recorder.new_record()/submit()
        exporter.shutdown()  # drains everything still pending
    """

    def __init__(
        self,
        recorder: Recorder,
        sink: SpanSink,
        *,
        interval_s: float | None = None,
        batch_size: int | None = None,
        timeout_s: float | None = None,
        drop_log_interval_s: float | None = None,
        meter_provider: metrics.MeterProvider | None = None,
        start: bool = True,
        build: Callable[[Any], str] | None = None,
    ) -> None:
        if interval_s is not None and interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.recorder = recorder
        self.sink = sink
        self.interval_s = (
            interval_s
            if interval_s is not None
            else config.env_int(config.OTEL_KVTRACE_EXPORT_INTERVAL_MS, config.DEFAULT_EXPORT_INTERVAL_MS) / 1000
        )
        self.batch_size = batch_size or config.env_int(
            config.OTEL_KVTRACE_EXPORT_BATCH_SIZE, config.DEFAULT_EXPORT_BATCH_SIZE
        )
        self.timeout_s = (
            timeout_s
            if timeout_s is not None
            else config.env_int(config.OTEL_KVTRACE_EXPORT_TIMEOUT_MS, config.DEFAULT_EXPORT_TIMEOUT_MS) / 1000
        )
        self.drop_log_interval_s = (
            drop_log_interval_s
            if drop_log_interval_s is not None
            else config.env_float(config.OTEL_KVTRACE_DROP_LOG_INTERVAL_S, config.DEFAULT_DROP_LOG_INTERVAL_S)
        )
        # ``build``: one record -> its spans' OTLP/JSON text, for a recorder of other records (asynccheck's
        # engine steps); a recorder with ``collect()`` turns its raw data into records at each export cycle
        self._build = build if build is not None else SpanBuilder(recorder.anchor).build_json
        self._collect: Callable[[], None] | None = getattr(recorder, "collect", None)
        self._export_lock = threading.Lock()  # one export cycle at a time (worker or force_flush caller)
        self._stopping = threading.Event()  # set by shutdown only, never by a recording thread
        self._shutdown_lock = threading.Lock()
        self._shutdown_done = False
        self._broken = False  # span building failed once: tracing is disabled, records are discarded
        self._thread: threading.Thread | None = None
        self._deadline: float | None = None
        self.exported_tasks = 0  # accepted by the sink (delivered, or spooled by a DeliveringSink)
        self.failed_batches = 0
        self._counted_here = 0  # drops this exporter counted on the recorder (the rest: hand-off full)
        self._in_batch = 0  # records taken from the recorder and not yet settled
        self._abandoned = False  # shutdown counted what a stuck worker still held
        self._settle_lock = threading.Lock()  # a batch is settled by the worker or abandoned by shutdown
        self._undropped = 0  # abandoned (counted dropped) records the sink accepted after all
        self._batches_taken = 0  # progress of the final drain into a spool
        self._dropped_reported = 0  # pushed to the metric counter
        self._dropped_logged = 0
        self._last_drop_log = float("-inf")
        # The global provider is a proxy until the application sets one, so this works either way.
        meter = (meter_provider or metrics.get_meter_provider()).get_meter("otel_kvtrace")
        self._drop_counter = meter.create_counter(
            DROPPED_METRIC, unit="{record}", description="Task records lost before export (queue full or export failed)"
        )
        observe_export_stats(meter, self.stats)
        self._atexit = _weak_callback(self, "shutdown_at_exit")
        atexit.register(self._atexit)
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=_weak_callback(self, "_after_fork_in_child"))
        # multiprocessing children leave through os._exit, past atexit: the final drain is also one of its
        # finalizers (run by Process._bootstrap), registered again in a child, which clears inherited ones
        self._register_exit_drain()
        mp_util.register_after_fork(self, BackgroundExporter._register_exit_drain)
        if start:
            self.start()

    # ---- lifecycle ------------------------------------------------------------------------------
    def _register_exit_drain(self) -> None:
        self._mp_exit = mp_util.Finalize(None, self._atexit, exitpriority=10)

    def start(self) -> None:
        """Start the worker thread (done by the constructor unless ``start=False``)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._thread.start()

    def update_resource(self, attributes: Mapping[str, Any]) -> None:
        """Merge ``attributes`` into the resource of everything exported from now on (sinks that can)."""
        update = getattr(self.sink, "update_resource", None)
        if update is not None:
            update(dict(attributes))

    def stats(self) -> ExportStats:
        """Counts of recorded tasks by where they are now (see ``ExportStats``)."""
        recorder = self.recorder
        lost_here = recorder.dropped  # hand-off overflow + what this exporter counted
        pending = recorder.pending + self._in_batch
        delivered, spooled, sink_dropped = self.exported_tasks, 0, 0
        sink_stats = getattr(self.sink, "stats", None)
        if sink_stats is not None:
            s = sink_stats()
            delivered, spooled, sink_dropped = s.delivered, s.spooled, s.dropped
        handoff = lost_here - self._counted_here
        recorded = recorder.submitted + handoff
        if self._abandoned:
            pending = 0  # already counted as dropped
        return ExportStats(recorded, delivered, spooled, lost_here + sink_dropped - self._undropped, pending)

    def force_flush(self, timeout_s: float | None = None) -> bool:
        """Export what is pending now, on the caller's thread. True if nothing was left behind."""
        if self._shutdown_done:
            return self.recorder.pending == 0
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        if not self._export_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return False
        try:
            if self._collect is not None:
                self._collect()
            self._export_pending(deadline, limit=self.recorder.pending)
        finally:
            self._export_lock.release()
        return self.recorder.pending == 0

    def shutdown(self, timeout_s: float | None = None) -> bool:
        """Drain everything pending, stop the thread, close the sink. Idempotent; never raises.

        Returns True when every pending record was delivered in time (none left at the deadline, no
        batch failed during the drain). Records still pending at the deadline are counted as dropped,
        unless the sink spools (``DeliveringSink``): then they are all written to the spool first.
        """
        return self._shutdown(self.timeout_s if timeout_s is None else timeout_s, grace_s=1.0)

    def shutdown_at_exit(self) -> bool:
        """The drain of a dying process (atexit, multiprocessing's ``os._exit``): every network wait, the
        sink's included, fits in ``OTEL_KVTRACE_EXIT_DRAIN_MS``. With a spool, what is pending is first
        written to it (local disk, bounded by the spool cap, not by the deadline), then delivered until
        the deadline; what a stuck worker still holds is counted as dropped rather than waited for."""
        return self._shutdown(config.exit_drain_s(), grace_s=0.0, at_exit=True)

    def _shutdown(self, timeout: float, *, grace_s: float, at_exit: bool = False) -> bool:
        """``shutdown`` with ``timeout``; a worker stuck in the sink past it gets ``grace_s`` more after
        the sink is told to abort."""
        with self._shutdown_lock:
            if self._shutdown_done:
                return self.recorder.pending == 0
            self._shutdown_done = True
        failed_before = self.failed_batches
        with contextlib.suppress(Exception):  # interpreter teardown
            atexit.unregister(self._atexit)
            self._mp_exit.cancel()
        self._deadline = time.monotonic() + timeout
        self._stopping.set()
        thread = self._thread
        if thread is not None and thread.is_alive() and thread is not threading.current_thread():
            thread.join(timeout)
            self._join_while_spooling(thread)
            if thread.is_alive():
                self._safe_sink_shutdown(0.0)  # aborts retry back-off of a sink sending inline
                thread.join(grace_s)
        else:  # never started (or called from the worker): drain here
            with self._export_lock:
                self._export_pending(self._final_deadline(), final=True)
        if thread is not None and thread.is_alive():
            # The worker is stuck inside a sink: what it and the recorder hold is lost; count it once.
            with self._settle_lock:
                self._abandoned = True
                left = self.recorder.pending + self._in_batch
            self.recorder.count_drop(left)
            self._counted_here += left
        elif left := self.recorder.pending:
            self._discard(self.recorder.drain(left))
        self._safe_sink_shutdown(max(0.0, self._deadline - time.monotonic()))
        self._report_drops(final=True)
        stats = self.stats()
        log = logger.info if stats.dropped == 0 and stats.spooled == 0 else logger.warning
        log("otel-kvtrace: export summary: %s (%s)%s", stats.line(),
            "balanced" if stats.balanced else "UNBALANCED: please report",
            f"; exit drain deadline {config.OTEL_KVTRACE_EXIT_DRAIN_MS}={timeout * 1000:.0f}"
            if at_exit and (stats.dropped or stats.spooled) else "")
        return left == 0 and self.failed_batches == failed_before and not self._broken and stats.spooled == 0

    def _final_deadline(self) -> float | None:
        """The final drain's deadline for taking records: none when they go to a spool (a local write)."""
        return None if isinstance(self.sink, DeliveringSink) else self._deadline

    def _join_while_spooling(self, thread: threading.Thread) -> None:
        """Past the deadline, wait for a worker still writing pending records to the spool while it
        makes progress (a batch per ``SPOOL_STALL_S``); a worker stuck on the disk is abandoned."""
        if not isinstance(self.sink, DeliveringSink):
            return
        while thread.is_alive():
            before = self._batches_taken
            thread.join(SPOOL_STALL_S)
            if self._batches_taken == before:
                return

    def _after_fork_in_child(self) -> None:
        # The parent's records and thread are not ours (the parent exports its records): start fresh.
        self._export_lock = threading.Lock()
        self._shutdown_lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = None
        # ... and neither are its counts: the child's stats() balance over the child's own records
        self.recorder.after_fork()
        self.exported_tasks = self.failed_batches = self._counted_here = self._in_batch = 0
        self._dropped_reported = self._dropped_logged = 0
        self._abandoned = False
        self._settle_lock = threading.Lock()
        self._undropped = self._batches_taken = 0
        if not self._shutdown_done:
            self.start()

    # ---- worker ---------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping.wait(self.interval_s):
                with self._export_lock:
                    self._export_pending(None)
            with self._export_lock:
                self._export_pending(self._final_deadline(), final=True)
        except BaseException as exc:  # noqa: BLE001 - the worker must never die loudly in a host process
            self._fail_internal(f"exporter thread: {exc!r}")

    def _export_pending(self, deadline: float | None, limit: int | None = None, *, final: bool = False) -> None:
        """Export batches until the recorder is empty, ``limit`` records were taken, or the deadline
        (``final``: the drain of ``shutdown``, not stopped by it)."""
        recorder = self.recorder
        if limit is None and self._collect is not None:
            self._collect()
        taken = 0
        while recorder.pending and (limit is None or taken < limit):
            if not final and deadline is None and self._stopping.is_set():
                break  # shutdown: the final drain (with its deadline) takes over
            if deadline is not None and time.monotonic() > deadline:
                break
            n = self.batch_size if limit is None else min(self.batch_size, limit - taken)
            with self._settle_lock:  # taken under the lock: shutdown counts it in ``_in_batch`` or not at all
                if self._abandoned:
                    break
                batch = recorder.drain(n)
                self._in_batch = len(batch)
            if not batch:
                break
            taken += len(batch)
            self._batches_taken += 1
            self._export_batch(batch)
        self._report_drops()

    def _export_batch(self, records: list[TaskRecord]) -> None:
        if self._broken:
            self._settle(records, ok=False)
            return
        build = self._build
        try:
            texts = []
            for i, rec in enumerate(records):
                texts.append(build(rec))
                if i & 7 == 7:
                    time.sleep(0)  # hand the GIL to waiting host threads between small slices
        except Exception as exc:  # noqa: BLE001 - a builder bug: stop tracing, keep the host running
            self._broken = True
            self._fail_internal(f"building spans failed: {exc!r}")
            self._settle(records, ok=False)
            return
        ok = False
        try:
            with suppress_instrumentation():
                ok = bool(self.sink.export(texts, self.recorder.dropped))
        except Exception as exc:  # noqa: BLE001 - a sink error loses this batch only
            logger.debug("otel-kvtrace: export failed: %r", exc)
        self.failed_batches += not ok
        self._settle(records, ok=ok)

    def _settle(self, records: list[TaskRecord], *, ok: bool) -> None:
        """Count the batch in hand once, under the lock shutdown abandons it under: here, or (abandoned)
        as shutdown's drop, moved back to delivered when the sink accepted the batch after all."""
        n = len(records)
        with self._settle_lock:
            if not self._abandoned:
                if ok:
                    self.exported_tasks += n
                else:
                    self.recorder.count_drop(n)
                    self._counted_here += n
            elif ok:  # shutdown counted it dropped, and the sink took it (a sink with stats counted it)
                self.exported_tasks += n
                self._undropped += n
            self._in_batch = 0
        self.recorder.recycle(records)

    def _discard(self, records: list[TaskRecord]) -> None:
        """Count ``records`` as dropped and recycle them."""
        if records:
            self.recorder.count_drop(len(records))
            self._counted_here += len(records)
        self.recorder.recycle(records)

    def _fail_internal(self, reason: str) -> None:
        with contextlib.suppress(Exception):
            self.recorder.disable(reason)  # logs once

    def _report_drops(self, *, final: bool = False) -> None:
        """Push new drops to the metric counter; warn at most once per ``drop_log_interval_s``."""
        sink_stats = getattr(self.sink, "stats", None)
        total = self.recorder.dropped + (sink_stats().dropped if sink_stats is not None else 0)
        delta = total - self._dropped_reported
        if delta > 0:
            with contextlib.suppress(Exception):  # a broken MeterProvider must not stop exporting
                self._drop_counter.add(delta)
            self._dropped_reported = total
        now = time.monotonic()
        if total > self._dropped_logged and (final or now - self._last_drop_log >= self.drop_log_interval_s):
            logger.warning(
                "otel-kvtrace: %d task records dropped (%d since last report): exporter behind, or the "
                "delivery spool full while the endpoint is unreachable; recording threads were not blocked",
                total,
                total - self._dropped_logged,
            )
            self._dropped_logged = total
            self._last_drop_log = now

    def _safe_sink_shutdown(self, timeout_s: float | None = None) -> None:
        try:
            with suppress_instrumentation():
                self.sink.shutdown(timeout_s)
        except Exception as exc:  # noqa: BLE001
            logger.debug("otel-kvtrace: sink shutdown failed: %r", exc)


def observe_export_stats(meter: metrics.Meter, stats: Callable[[], ExportStats], *, dropped: bool = False) -> None:
    """Delivered and spooled counts (and ``dropped``, for an exporter that counts no drops itself) as
    observable instruments reading ``stats`` (held weakly: a shut-down exporter can be freed)."""
    stats_ref = weakref.WeakMethod(stats)  # type: ignore[arg-type]
    meter.create_observable_counter(
        DELIVERED_METRIC, [_observe(stats_ref, "delivered")], unit="{record}",
        description="Task records acknowledged by the destination (receiver or file)")
    meter.create_observable_up_down_counter(
        SPOOLED_METRIC, [_observe(stats_ref, "spooled")], unit="{record}",
        description="Task records in the delivery spool on disk, not yet acknowledged")
    if dropped:
        meter.create_observable_counter(
            DROPPED_METRIC, [_observe(stats_ref, "dropped")], unit="{record}",
            description="Task records lost before export (queue full or export failed)")


def _observe(stats_ref: Any, field: str) -> Any:
    """An observable-instrument callback reading one ``ExportStats`` field (nothing once the exporter is gone)."""

    def callback(options: Any) -> list[metrics.Observation]:
        stats = stats_ref()
        if stats is None:
            return []
        try:
            return [metrics.Observation(getattr(stats(), field))]
        except Exception:  # noqa: BLE001 - a metrics read must never raise into the SDK's reader
            return []

    return callback


def _weak_callback(obj: Any, method: str) -> Any:
    ref = weakref.WeakMethod(getattr(obj, method))

    def call() -> None:
        bound = ref()
        if bound is not None:
            bound()

    return call


def build_resource(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """Resource attributes per docs/schema.md: the caller's, ``OTEL_RESOURCE_ATTRIBUTES``,
    ``OTEL_SERVICE_NAME`` (default ``kvtrace``), ``kvtrace.run_id``, ``process.pid``, ``host.name``.

    Precedence is the SDK's (``Resource.create``): attributes passed in code win over the environment.
    """
    from opentelemetry.sdk.resources import Resource

    merged = dict(Resource.create(dict(attributes)).attributes)
    service = merged.get("service.name")
    if not service or str(service).startswith("unknown_service"):
        merged["service.name"] = DEFAULT_SERVICE_NAME
    merged.setdefault("kvtrace.run_id", config.run_id())
    merged.setdefault("process.pid", os.getpid())
    merged.setdefault("host.name", socket.gethostname())
    return merged


def resolve_otlp(endpoint: str | None = None, protocol: str | None = None) -> tuple[str | None, str, bool]:
    """The one OTLP choice of every kvtrace signal: (endpoint or None for files, protocol, explicit).

    ``explicit`` is False when the endpoint came from the environment (then the SDK exporters resolve the
    per-signal URL themselves)."""
    if protocol is not None and protocol not in config.PROTOCOLS:
        raise ValueError(f"protocol must be one of {', '.join(config.PROTOCOLS)}, got {protocol!r}")
    target = endpoint or config.otlp_endpoint()
    chosen = (protocol or config.otlp_protocol()) if target else (protocol or config.DEFAULT_PROTOCOL)
    return target, chosen, bool(endpoint)


def create_sink(
    resource: Mapping[str, Any],
    *,
    out_dir: str | os.PathLike[str] | None = None,
    endpoint: str | None = None,
    protocol: str | None = None,
    spool_dir: str | os.PathLike[str] | None = None,
) -> SpanSink:
    """The sink the arguments and the standard OTel environment select (see ``create_exporter``).

    An OTLP endpoint gets a ``DeliveringSink`` (spool under ``spool_dir`` or ``OTEL_KVTRACE_SPOOL_DIR``,
    retry, split), unless ``OTEL_KVTRACE_SPOOL_MAX_MB=0`` asks for direct sending.
    """
    target, chosen, _explicit = resolve_otlp(endpoint, protocol)
    if config.sdk_disabled():
        return NullSink()
    run_id = str(resource.get("kvtrace.run_id") or config.run_id())
    if target:
        sink_class = OtlpGrpcSink if chosen == config.PROTOCOL_GRPC else OtlpHttpSink

        def make_transport() -> Any:
            # With only an environment endpoint, let the SDK resolve it (it knows the per-signal rules).
            return sink_class(resource, endpoint or None)

        max_mb = config.env_int(config.OTEL_KVTRACE_SPOOL_MAX_MB, config.DEFAULT_SPOOL_MAX_MB, minimum=0)
        if max_mb == 0:
            return make_transport()
        return DeliveringSink(
            make_transport,
            resource,
            spool_root=spool_dir if spool_dir is not None else config.spool_dir(),
            run_id=run_id,
            max_bytes=max_mb * 2**20,
            max_request_bytes=config.env_int(
                config.OTEL_KVTRACE_EXPORT_MAX_REQUEST_BYTES, config.DEFAULT_EXPORT_MAX_REQUEST_BYTES
            ),
        )
    directory = Path(out_dir) if out_dir is not None else Path(config.data_dir())
    return JsonLinesFileSink(directory, run_id, resource)


def create_exporter(
    recorder: Recorder,
    resource: Mapping[str, Any],
    *,
    out_dir: str | os.PathLike[str] | None = None,
    endpoint: str | None = None,
    protocol: str | None = None,
    spool_dir: str | os.PathLike[str] | None = None,
    meter_provider: metrics.MeterProvider | None = None,
) -> BackgroundExporter:
    """A started ``BackgroundExporter`` for ``recorder``, its sink chosen like any OTel SDK would.

    - ``endpoint`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``) set:
      OTLP with ``protocol`` (or ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_PROTOCOL``),
      ``grpc`` or ``http/protobuf`` (default); every batch is spooled to disk first and retried until
      the receiver acknowledges it (``DeliveringSink``, docs/export.md "Delivery").
    - no endpoint: OTLP/JSON lines in ``{out_dir}/traces/kvtrace-{run_id}-{pid}.jsonl``, ``out_dir``
      defaulting to ``OTEL_KVTRACE_DATA_DIR`` or ``./kvtrace-data``.
    - ``OTEL_SDK_DISABLED=true``: records are drained and discarded.

    Example::

        exporter = create_exporter(recorder, {"kvtrace.source": "replica", "kvtrace.run_id": "r1"})
    """
    full_resource = build_resource(resource)
    sink = create_sink(full_resource, out_dir=out_dir, endpoint=endpoint, protocol=protocol, spool_dir=spool_dir)
    return BackgroundExporter(recorder, sink, meter_provider=meter_provider)
