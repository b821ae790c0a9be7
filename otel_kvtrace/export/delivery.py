"""Delivery that loses nothing acknowledged: spool first, then send with back-off, split what is too large.

``DeliveringSink`` is the ``SpanSink`` the OTLP endpoints get from ``create_sink``. ``export`` (the
exporter's thread, or the exporter agent) only writes the batch to the :class:`~.spool.Spool` and
returns; a ``kvtrace-sender`` thread sends the oldest spooled batch, one request at a time, and
deletes it once the receiver acknowledged it. A slow, refusing or dead endpoint therefore delays
delivery but never backs up the recorder. Every task handed to the sink is, at any moment, in
exactly one of: delivered, spooled (on disk), dropped (the spool cap was reached, oldest first; or
the receiver answered with an OTLP ``partial_success`` rejecting spans: ``refused``):
``accepted == delivered + spooled + dropped``.

Retry policy: transient outcomes (gRPC UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, ...;
HTTP 429/502/503/504; no answer) are retried with exponential back-off and jitter, or after the
receiver's ``Retry-After`` / ``RetryInfo`` delay. A request above the receiver's message limit is
split by trace into halves. A permanent refusal (e.g. INVALID_ARGUMENT, HTTP 400) keeps the batch on
disk for ``kvtrace resend`` and moves on. At shutdown the sink keeps sending until its deadline;
whatever is left stays in the spool, and one log line names the command that resends it.
"""

from __future__ import annotations

import logging
import os
import random
import shlex
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from opentelemetry.instrumentation.utils import suppress_instrumentation
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from otel_kvtrace import config
from otel_kvtrace.export.encode import line_to_request, resource_text, texts_to_json_line
from otel_kvtrace.export.otlp_json import request_to_json_line
from otel_kvtrace.export.sinks import OK, REJECTED, RETRY, TOO_LARGE, Attempt
from otel_kvtrace.export.spool import Spool, SpoolEntry, is_spool_dir

logger = logging.getLogger("otel_kvtrace")

SENDER_THREAD_NAME = "kvtrace-sender"
INITIAL_BACKOFF_S = 0.1
MAX_BACKOFF_S = 5.0
MAX_HINT_S = 60.0  # a receiver's Retry-After beyond this is capped


class Transport(Protocol):
    """Sends one request once (``OtlpGrpcSink`` / ``OtlpHttpSink``)."""

    endpoint: Any
    protocol: str

    def attempt(self, request: ExportTraceServiceRequest, abort: threading.Event) -> Attempt: ...

    def shutdown(self) -> None: ...


@dataclass(slots=True, frozen=True)
class DeliveryStats:
    """Tasks by where they are: ``accepted == delivered + spooled + dropped`` always holds.

    ``dropped`` includes ``refused``: tasks of requests the receiver acknowledged with a partial success
    (``rejected_spans``). Which spans it rejected is not said, so ``min(tasks, rejected_spans)`` of the
    request's tasks are counted as lost (each rejected span breaks at most one task)."""

    accepted: int
    delivered: int
    spooled: int
    dropped: int
    spooled_batches: int
    retries: int
    splits: int
    rejected_batches: int
    refused: int = 0
    refused_spans: int = 0


def root_count(request: ExportTraceServiceRequest) -> int:
    """Tasks in a request: one root span (no parent) per task trace."""
    return sum(1 for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans if not s.parent_span_id)


def split_request(request: ExportTraceServiceRequest) -> list[ExportTraceServiceRequest]:
    """Two requests holding the spans of ``request``, split between traces (one span each at worst).

    Returns ``[request]`` when it holds a single span (nothing left to split).
    """
    units: list[tuple[int, int, Any]] = [
        (ri, si, span)
        for ri, rs in enumerate(request.resource_spans)
        for si, ss in enumerate(rs.scope_spans)
        for span in ss.spans
    ]
    if len(units) <= 1:
        return [request]
    cut = len(units) // 2
    # move the cut to a trace boundary when there is one, so a task's spans travel together
    for probe in sorted(range(1, len(units)), key=lambda i: abs(i - cut)):
        if units[probe][2].trace_id != units[probe - 1][2].trace_id:
            cut = probe
            break
    return [_subrequest(request, units[:cut]), _subrequest(request, units[cut:])]


def _subrequest(request: ExportTraceServiceRequest, units: list[tuple[int, int, Any]]) -> ExportTraceServiceRequest:
    out = ExportTraceServiceRequest()
    scopes: dict[tuple[int, int], Any] = {}
    resources: dict[int, Any] = {}
    for ri, si, span in units:
        ss = scopes.get((ri, si))
        if ss is None:
            rs = resources.get(ri)
            if rs is None:
                rs = resources[ri] = out.resource_spans.add()
                src = request.resource_spans[ri]
                rs.resource.CopyFrom(src.resource)
                rs.schema_url = src.schema_url
            src_ss = request.resource_spans[ri].scope_spans[si]
            ss = scopes[(ri, si)] = rs.scope_spans.add()
            ss.scope.CopyFrom(src_ss.scope)
            ss.schema_url = src_ss.schema_url
        ss.spans.add().CopyFrom(span)
    return out


def resend_command(directory: Path, transport: Transport) -> str:
    """The shell command that sends a left-over spool directory."""
    endpoint = getattr(transport, "endpoint_url", None) or transport.endpoint
    return (f"kvtrace resend {shlex.quote(str(directory))} --endpoint {shlex.quote(str(endpoint))} "
            f"--protocol {transport.protocol}")


class Sender:
    """Delivers a spool's batches oldest first, one request at a time, with the retry policy above.

    Runs on its own thread inside a sink (``start``), or on the caller's thread (``kvtrace resend``:
    ``run_until``). Counters are updated under one lock so ``stats`` is always consistent.
    """

    def __init__(self, spool: Spool, transport: Transport, *, max_request_bytes: int) -> None:
        self.spool = spool
        self.transport = transport
        self.max_request_bytes = max_request_bytes
        self.delivered = 0
        self.retries = 0
        self.splits = 0
        self.rejected_batches = 0
        self.refused = 0  # tasks lost to partial successes
        self.refused_spans = 0
        self._partial_logged = 0.0
        self._step_errors = 0
        self.failing_since: float | None = None
        self.last_failure = ""
        self._wake = threading.Event()
        self.abort = threading.Event()  # interrupts a back-off or an in-flight gRPC call
        self._stop = threading.Event()
        self._closed = False
        self.lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._backoff = INITIAL_BACKOFF_S

    # ---- thread ---------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=SENDER_THREAD_NAME, daemon=True)
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def _run(self) -> None:
        with suppress_instrumentation():
            while not self._stop.is_set():
                try:
                    sent = self.step(None)
                except Exception as exc:  # noqa: BLE001 - one bad step must not end delivery for good
                    self._step_failed(exc)
                    sent = False
                if not sent:
                    self._wake.wait(0.5)
                    self._wake.clear()

    def _step_failed(self, exc: Exception) -> None:
        """Give the claimed batches back (retried after a back-off) and say so, first time loudly."""
        self.spool.release_claimed()
        self._step_errors += 1
        log = logger.error if self._step_errors == 1 else logger.debug
        log("otel-kvtrace: sending from %s failed (%r, %d times so far); the batches stay spooled and are retried",
            self.spool.directory, exc, self._step_errors)
        self.abort.wait(min(MAX_BACKOFF_S, INITIAL_BACKOFF_S * 2 ** min(self._step_errors, 6)))

    def stop(self, join_s: float) -> None:
        """Interrupt and stop the thread; after this no counter or file changes."""
        self._stop.set()
        self.abort.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(join_s)
        with self.lock:
            self._closed = True

    def run_until(self, deadline: float | None, progress: Callable[[], None] | None = None) -> None:
        """Send on the caller's thread until nothing sendable is left or the deadline passes."""
        with suppress_instrumentation():
            while self.spool.sendable and (deadline is None or time.monotonic() < deadline):
                self.step(deadline)
                if progress is not None:
                    progress()

    # ---- one batch ------------------------------------------------------------------------------
    def step(self, deadline: float | None) -> bool:
        """Deliver the oldest batch (with the small ones after it in the same request, when they fit),
        retrying until it is acknowledged, refused, or the deadline / a stop comes. False when the spool
        had nothing to send."""
        group = self.spool.claim(self.max_request_bytes)
        if not group:
            return False
        requests = []
        for entry in group:
            try:
                requests.append(line_to_request(entry.path.read_bytes()))
            except (OSError, ValueError) as exc:  # unreadable: keep it for a human, do not loop on it
                logger.warning("otel-kvtrace: spooled batch %s unreadable (%s); left on disk", entry.path, exc)
                for other in group:
                    if other is entry:
                        self._reject(entry)
                    else:
                        self.spool.release(other)
                return True
        if len(group) > 1:
            merged = ExportTraceServiceRequest()
            for req in requests:
                merged.resource_spans.extend(req.resource_spans)
            if merged.ByteSize() <= self.max_request_bytes and self._send_group(group, merged, deadline):
                return True
            for other in group[1:]:
                self.spool.release(other)
            if self._stop.is_set() or (deadline is not None and time.monotonic() >= deadline):
                self.spool.release(group[0])
                return True
        return self._send_one(group[0], requests[0], deadline)

    def _send_group(self, group: list[SpoolEntry], request: ExportTraceServiceRequest, deadline: float | None) -> bool:
        """Send several whole batches as one request. False: not settled, go on one batch at a time."""
        while True:
            result = self.transport.attempt(request, self.abort)
            if result.outcome == OK:
                self._recovered()
                refused = self._refused(result, request)
                with self.lock:
                    if self._closed:
                        return True
                    for entry in group:
                        self.spool.done(entry)
                        self.delivered += entry.tasks
                    self.delivered -= refused
                    self.refused += refused
                    self.refused_spans += result.rejected_spans
                return True
            if result.outcome != RETRY:
                return False  # too large or refused: the batches are tried one by one
            self._failed(result)
            if self._stop.is_set() or not self._back_off(result, deadline):
                return False

    def _send_one(self, entry: SpoolEntry, request: ExportTraceServiceRequest, deadline: float | None) -> bool:
        parts = self._fit(request)
        sent = refused = refused_spans = 0
        while sent < len(parts):
            result = self.transport.attempt(parts[sent], self.abort)
            if result.outcome == OK:
                refused += self._refused(result, parts[sent])
                refused_spans += result.rejected_spans
                sent += 1
                self._recovered()
                continue
            if result.outcome == TOO_LARGE and len(split := split_request(parts[sent])) > 1:
                size = parts[sent].ByteSize()
                self.max_request_bytes = max(1, min(self.max_request_bytes, size // 2))
                parts[sent : sent + 1] = split
                with self.lock:
                    self.splits += 1
                continue
            if result.outcome in (REJECTED, TOO_LARGE):
                logger.warning("otel-kvtrace: receiver %s refused a batch (%s); it stays in %s for `kvtrace resend`",
                               self.transport.endpoint, result.detail, self.spool.directory)
                self._settle(entry, parts, sent, (refused, refused_spans), rejected=True)
                return True
            self._failed(result)
            if self._stop.is_set() or not self._back_off(result, deadline):
                self._settle(entry, parts, sent, (refused, refused_spans))
                return True
        self._settle(entry, parts, sent, (refused, refused_spans))
        return True

    def _refused(self, result: Attempt, request: ExportTraceServiceRequest) -> int:
        """Tasks lost to a partial success (see ``DeliveryStats``); logged at most every 10 s."""
        if result.rejected_spans <= 0:
            return 0
        lost = min(root_count(request), result.rejected_spans)
        now = time.monotonic()
        if now - self._partial_logged >= 10.0:
            self._partial_logged = now
            logger.warning("otel-kvtrace: receiver %s rejected %d spans of a request (%s); %d tasks counted as "
                           "dropped", self.transport.endpoint, result.rejected_spans, result.detail, lost)
        return lost

    def _fit(self, request: ExportTraceServiceRequest) -> list[ExportTraceServiceRequest]:
        """Split until every part is within ``max_request_bytes`` (or is a single span)."""
        todo, out = [request], []
        while todo:
            req = todo.pop(0)
            halves = split_request(req) if req.ByteSize() > self.max_request_bytes else [req]
            if len(halves) == 1:
                out.append(req)
            else:
                todo[:0] = halves
                with self.lock:
                    self.splits += 1
        return out

    def _settle(self, entry: SpoolEntry, parts: list[ExportTraceServiceRequest], sent: int,
                refused: tuple[int, int] = (0, 0), *, rejected: bool = False) -> None:
        """Account for ``parts[:sent]`` acknowledged (``refused`` = (tasks, spans) of them lost to partial
        successes); keep the rest on disk (exactly the rest)."""
        with self.lock:
            if self._closed:
                return  # shut down meanwhile: the batch stays whole in the spool (resend may duplicate)
            self.refused += refused[0]
            self.refused_spans += refused[1]
            self.delivered -= refused[0]
            if sent == len(parts):
                self.spool.done(entry)
                self.delivered += entry.tasks
                return
            if sent:
                rest = parts[sent:]
                left = sum(root_count(p) for p in rest)
                merged = ExportTraceServiceRequest()
                for part in rest:
                    merged.resource_spans.extend(part.resource_spans)
                self.delivered += entry.tasks - left  # the identity is kept on the batch's own count
                entry = self.spool.replace(entry, request_to_json_line(merged), left)
            if rejected:
                self.rejected_batches += 1
            self.spool.release(entry, rejected=rejected)

    def _reject(self, entry: SpoolEntry) -> None:
        with self.lock:
            self.rejected_batches += 1
            self.spool.release(entry, rejected=True)

    def _failed(self, result: Attempt) -> None:
        with self.lock:
            self.retries += 1
        if self.failing_since is None:
            self.failing_since = time.monotonic()
            logger.warning("otel-kvtrace: OTLP endpoint %s not accepting (%s); batches wait in %s and are retried",
                           self.transport.endpoint, result.detail, self.spool.directory)
        self.last_failure = result.detail

    def _recovered(self) -> None:
        self._backoff = INITIAL_BACKOFF_S
        if self.failing_since is not None:
            logger.warning("otel-kvtrace: OTLP endpoint %s accepting again after %.1f s; %d batches waiting",
                           self.transport.endpoint, time.monotonic() - self.failing_since, self.spool.batches - 1)
            self.failing_since = None

    def _back_off(self, result: Attempt, deadline: float | None) -> bool:
        """Wait before the next attempt. False when the deadline or a stop comes first."""
        if result.delay is not None:
            delay = min(result.delay, MAX_HINT_S)
        else:
            delay = self._backoff * random.uniform(0.8, 1.2)
            self._backoff = min(MAX_BACKOFF_S, self._backoff * 2)
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            delay = min(delay, remaining)
        return not self.abort.wait(delay)


class DeliveringSink:
    """A ``SpanSink`` that spools every batch, then delivers it through ``transport`` (see module doc).

    Example::

        sink = DeliveringSink(lambda: OtlpGrpcSink(resource, "http://collector:4317"), resource,
                              spool_root="./kvtrace-data/spool", run_id="r1")
        sink.export(texts, 0)      # on disk now; sent by the kvtrace-sender thread
        sink.shutdown(timeout_s=10)
    """

    def __init__(
        self,
        make_transport: Callable[[], Transport],
        resource: Mapping[str, Any],
        *,
        spool_root: str | os.PathLike[str],
        run_id: str,
        max_bytes: int,
        max_request_bytes: int,
    ) -> None:
        self._make_transport = make_transport
        self._resource_attrs = dict(resource)
        self._resource = resource_text(resource)
        self.spool_root = Path(spool_root)
        self.run_id = run_id
        self.max_bytes = max_bytes
        self.max_request_bytes = max_request_bytes
        self._shutdown_done = False
        self._start(os.getpid())

    def _start(self, pid: int) -> None:
        if getattr(self, "spool", None) is not None:
            self.spool.forget_lock()  # forked: the parent's spool stays locked by the parent
        self._pid = pid
        self.accepted = 0
        self.transport = self._make_transport()
        self.endpoint = self.transport.endpoint
        self.protocol = self.transport.protocol
        from otel_kvtrace.export.sinks import trace_file_path

        name = trace_file_path(".", self.run_id, pid).stem.removeprefix("kvtrace-")
        meta = {"endpoint": str(getattr(self.transport, "endpoint_url", None) or self.endpoint),
                "protocol": self.protocol, "pid": pid, "run_id": self.run_id}
        self.spool = Spool(self._fresh_directory(name), self.max_bytes, meta, lock=True)
        self.sender = Sender(self.spool, self.transport, max_request_bytes=self.max_request_bytes)
        self.sender.start()

    def _fresh_directory(self, name: str) -> Path:
        """``spool_root/name``, or ``name.1``, ``name.2``... when an earlier process (same run id and pid,
        e.g. a restarted container) left a spool there: that one is kept for ``kvtrace resend``, never
        mixed into this process's counts."""
        directory, n = self.spool_root / name, 0
        while is_spool_dir(directory):
            logger.warning("otel-kvtrace: an earlier process left undelivered batches in %s; resend with: "
                           "kvtrace resend %s", directory, shlex.quote(str(directory)))
            n += 1
            directory = self.spool_root / f"{name}.{n}"
        return directory

    def update_resource(self, attributes: Mapping[str, Any]) -> None:
        """Add attributes to the resource of later batches."""
        self._resource_attrs = {**self._resource_attrs, **attributes}
        self._resource = resource_text(self._resource_attrs)

    def export(self, span_texts: Sequence[str], dropped: int) -> bool:
        """Spool one batch (False: it could not be stored, and the caller counts it as dropped)."""
        if os.getpid() != self._pid:  # forked: the parent's spool and thread are not ours
            self._start(os.getpid())
        if self._shutdown_done:
            return False
        line = texts_to_json_line(span_texts, self._resource, dropped + self.spool.evicted_tasks + self.sender.refused)
        try:
            stored = self.spool.put(line, len(span_texts))
        except OSError as exc:
            logger.warning("otel-kvtrace: cannot write to spool %s (%s); batch dropped", self.spool.directory, exc)
            return False
        if not stored:
            return False
        with self.sender.lock:
            self.accepted += len(span_texts)
        self.sender.wake()
        return True

    def stats(self) -> DeliveryStats:
        """Where every accepted task is now (consistent snapshot). A forked child that has not exported yet
        has accepted nothing: it reports zeros and never touches the parent's lock (held at fork, maybe)."""
        if os.getpid() != self._pid:
            return DeliveryStats(0, 0, 0, 0, 0, 0, 0, 0)
        sender, spool = self.sender, self.spool
        with sender.lock:
            return DeliveryStats(
                accepted=self.accepted,
                delivered=sender.delivered,
                spooled=spool.tasks,
                dropped=spool.evicted_tasks + sender.refused,
                spooled_batches=spool.batches,
                retries=sender.retries,
                splits=sender.splits,
                rejected_batches=sender.rejected_batches,
                refused=sender.refused,
                refused_spans=sender.refused_spans,
            )

    def flush(self, timeout_s: float) -> bool:
        """Wait until everything sendable was delivered, at most ``timeout_s``. True when the spool is empty."""
        if os.getpid() != self._pid:
            return True  # forked, nothing exported here yet
        deadline = time.monotonic() + timeout_s
        self.sender.wake()
        while self.spool.sendable and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.spool.batches == 0

    def shutdown(self, timeout_s: float | None = None) -> None:
        """Deliver what is left until ``timeout_s`` (default ``OTEL_KVTRACE_EXPORT_TIMEOUT_MS``), then stop
        (every wait within ``timeout_s``); a non-empty spool is logged with its resend command. Idempotent."""
        if self._shutdown_done or os.getpid() != self._pid:
            return
        self._shutdown_done = True
        if timeout_s is None:
            timeout_s = config.env_int(config.OTEL_KVTRACE_EXPORT_TIMEOUT_MS, config.DEFAULT_EXPORT_TIMEOUT_MS) / 1000
        deadline = time.monotonic() + timeout_s
        self.flush(timeout_s)
        self.sender.stop(join_s=min(1.0, max(0.0, deadline - time.monotonic())))  # aborted: ends within ms
        try:
            self.transport.shutdown()
        except Exception as exc:  # noqa: BLE001
            logger.debug("otel-kvtrace: transport shutdown failed: %r", exc)
        stats = self.stats()
        if stats.spooled:
            logger.warning(
                "otel-kvtrace: %d task records (%d batches) not delivered to %s (%s); kept in %s. Resend with: %s",
                stats.spooled, stats.spooled_batches, self.endpoint, self.sender.last_failure or "deadline",
                self.spool.directory, resend_command(self.spool.directory, self.transport),
            )
            self.spool.close()  # unlocked: `kvtrace resend` may take it from now on
        else:
            self.spool.remove_if_empty()
