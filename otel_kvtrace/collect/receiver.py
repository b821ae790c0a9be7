"""The embedded OTLP receiver: gRPC + HTTP endpoints -> bounded queue -> one OTLP/JSON lines file per signal."""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Self, TypeVar

from otel_kvtrace import config
from otel_kvtrace.collect.grpc_server import GrpcEndpoint
from otel_kvtrace.collect.http_server import HttpEndpoint
from otel_kvtrace.collect.bind import check_host
from otel_kvtrace.collect.queue import ByteBoundedQueue, MemoryBudget
from otel_kvtrace.collect.stats import ReceiverStats, StatsCounter
from otel_kvtrace.collect.validate import METRICS, TRACES, AcceptResult, Signal
from otel_kvtrace.collect.writer import JsonLinesWriter, PendingWrite
from otel_kvtrace.export.otlp_json import MAX_LINE_BYTES

_Endpoint = TypeVar("_Endpoint", GrpcEndpoint, HttpEndpoint)

DEFAULT_OUT_DIR = config.DEFAULT_TRACES_DIR
DEFAULT_HOST = "127.0.0.1"
DEFAULT_GRPC_PORT = 4317
DEFAULT_HTTP_PORT = 4318
DEFAULT_MAX_QUEUE_BYTES = 64 * 1024 * 1024
"""Request bytes that may wait for the writer; beyond it senders get RESOURCE_EXHAUSTED / 503 and retry."""
DEFAULT_MAX_REQUEST_BYTES = 64 * 1024 * 1024
"""Largest accepted request, after decompression (the OTel Python HTTP exporter's own default limit)."""
DEFAULT_MAX_MEMORY_BYTES = 256 * 1024 * 1024
"""Bytes that all requests being read and decompressed at once may hold; beyond it: 503, retry."""
DEFAULT_ACK_TIMEOUT_S = 5.0
"""How long a sender waits for its line to be written and fsync-ed before it is told to retry."""


def collected_file_name(pid: int | None = None) -> str:
    """Name of the file a receiver in process ``pid`` writes: ``collected-{pid}.jsonl``."""
    return f"collected-{os.getpid() if pid is None else pid}.jsonl"


def collected_metrics_path(out_dir: str | os.PathLike[str], pid: int | None = None) -> Path:
    """Where a receiver in process ``pid`` writes metrics: ``{out}/metrics/otlp-metrics-collected-{pid}.jsonl``,
    the layout ``otel_kvtrace.resources`` reads beside the traces (and the trace loader skips)."""
    return Path(out_dir) / "metrics" / f"otlp-metrics-collected-{os.getpid() if pid is None else pid}.jsonl"


class PortInUseError(OSError):
    """A receiver port could not be bound (usually: another process listens on it)."""

    def __init__(self, protocol: str, host: str, port: int, option: str, detail: str) -> None:
        self.protocol, self.host, self.port, self.option = protocol, host, port, option
        super().__init__(
            f"{protocol} port {port} on {host} is already in use or cannot be bound ({detail}); "
            f"stop the other listener (an OpenTelemetry Collector?) or choose another port with {option} "
            f"(or check --host)"
        )


class OutputDirError(OSError):
    """The output directory or file cannot be created or opened for append."""

    def __init__(self, path: Path, detail: str) -> None:
        self.path = path
        super().__init__(f"cannot write {path} ({detail}); choose a writable directory with --out")


class Receiver:
    """OTLP trace and metrics receiver writing every accepted request as one OTLP/JSON line to ``out_dir``
    (traces: ``collected-{pid}.jsonl``; metrics: ``metrics/otlp-metrics-collected-{pid}.jsonl``).

    Several worker processes can export to it at once. A request is answered success only after its line
    was written and fsync-ed; when it cannot be written (disk full) the answer is UNAVAILABLE / 503, which
    the OTLP exporters retry. Memory is bounded by ``max_queue_bytes`` (lines waiting for the writer) and
    ``max_memory_bytes`` (bodies being read and inflated at once): beyond either, requests are refused with
    RESOURCE_EXHAUSTED (gRPC) or 503 (HTTP). ``stop`` refuses new requests, waits for running ones and
    writes everything accepted before returning. Binding anything but loopback needs ``allow_remote``.

    Example::

        rx = Receiver("kvtrace-data/traces", grpc_port=4317, http_port=4318)
        rx.start()
        ...                       # workers export with OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4317
        print(rx.stop().summary())
    """

    def __init__(
        self,
        out_dir: str | os.PathLike[str] = DEFAULT_OUT_DIR,
        grpc_port: int | None = DEFAULT_GRPC_PORT,
        http_port: int | None = DEFAULT_HTTP_PORT,
        host: str = DEFAULT_HOST,
        max_queue_bytes: int = DEFAULT_MAX_QUEUE_BYTES,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        max_memory_bytes: int = DEFAULT_MAX_MEMORY_BYTES,
        allow_remote: bool = False,
        ack_timeout_s: float = DEFAULT_ACK_TIMEOUT_S,
        max_line_bytes: int = MAX_LINE_BYTES,
    ) -> None:
        if grpc_port is None and http_port is None:
            raise ValueError("enable at least one of grpc_port and http_port")
        for name, port in (("grpc_port", grpc_port), ("http_port", http_port)):
            if port is not None and not 0 <= port <= 65535:
                raise ValueError(f"{name} must be in 0..65535 (0 picks a free port), got {port}")
        if max_memory_bytes < 2 * max_request_bytes:  # a lone request must always fit: body + inflated body
            raise ValueError(f"max_memory_bytes ({max_memory_bytes}) must be >= 2 * max_request_bytes "
                             f"({max_request_bytes})")
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / collected_file_name()
        self.metrics_path = collected_metrics_path(self.out_dir)
        self.host = check_host(host, allow_remote)
        self._grpc_port_wanted = grpc_port
        self._http_port_wanted = http_port
        self._max_request_bytes = max_request_bytes
        self._max_line_bytes = max_line_bytes
        self._ack_timeout_s = ack_timeout_s
        self.memory = MemoryBudget(max_memory_bytes)
        self._stats = StatsCounter()
        # one queue + writer per signal (each file has one appender); each queue has the same byte bound
        self._queues: dict[str, ByteBoundedQueue[PendingWrite]] = {
            s.name: ByteBoundedQueue(max_queue_bytes) for s in (TRACES, METRICS)}
        self._writers = {
            TRACES.name: JsonLinesWriter(self.path, self._queues[TRACES.name], self._stats),
            METRICS.name: JsonLinesWriter(self.metrics_path, self._queues[METRICS.name], self._stats,
                                          items_counter="metric_points_written"),
        }
        self._grpc: GrpcEndpoint | None = None
        self._http: HttpEndpoint | None = None
        self._stopping = False
        self._state_lock = threading.Lock()
        self._started = False
        self._stopped = False

    @property
    def grpc_port(self) -> int | None:
        """The bound gRPC port (after ``start``; useful with port 0)."""
        return self._grpc.port if self._grpc else None

    @property
    def http_port(self) -> int | None:
        """The bound HTTP port (after ``start``; useful with port 0)."""
        return self._http.port if self._http else None

    def start(self) -> Receiver:
        """Bind both ports and start serving; raise ``PortInUseError`` naming the port and option on failure."""
        if self._started:
            raise RuntimeError("Receiver.start() called twice")
        self._started = True
        try:
            if self._grpc_port_wanted is not None:
                self._grpc = self._bind(GrpcEndpoint, "grpc", self._grpc_port_wanted, self._malformed_grpc, "--grpc-port")
            if self._http_port_wanted is not None:
                self._http = self._bind(HttpEndpoint, "http", self._http_port_wanted, self._malformed_http, "--http-port")
            for writer in self._writers.values():
                try:
                    writer.start()
                except OSError as exc:
                    raise OutputDirError(writer.path, str(exc)) from exc
        except BaseException:
            if self._grpc is not None:
                self._grpc.stop(0)
                self._grpc = None
            if self._http is not None:
                self._http.stop(0)
                self._http = None
            raise
        if self._grpc is not None:
            self._grpc.start()
        if self._http is not None:
            self._http.start()
        return self

    def _bind(
        self, endpoint: type[_Endpoint], protocol: str, port: int, on_malformed: Callable[[], None], option: str
    ) -> _Endpoint:
        """Bind one endpoint (not started yet); a port that cannot be bound raises ``PortInUseError`` naming
        ``option``."""
        try:
            return endpoint(
                self.host, port, functools.partial(self._accept, protocol=protocol), on_malformed,
                self._max_request_bytes, self.memory, self._stats,
            )
        except OSError as exc:
            raise PortInUseError(protocol, self.host, port, option, str(exc)) from exc

    def stats(self) -> ReceiverStats:
        """Current counters."""
        snap = self._stats.snapshot()
        snap.queue_high_water_bytes = max(q.high_water_bytes for q in self._queues.values())
        return snap

    def stop(self, grace_s: float = 10.0) -> ReceiverStats:
        """Refuse new requests, finish running ones, write everything accepted, close the file; idempotent."""
        with self._state_lock:
            self._stopping = True
            already = self._stopped
            self._stopped = True
        if not already and self._started:
            if self._grpc is not None:
                self._grpc.stop(grace_s)
            if self._http is not None:
                self._http.stop(grace_s)
            for writer in self._writers.values():
                writer.stop()
        return self.stats()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- called by the endpoints' threads ---------------------------------------------------

    def _accept(self, signal: Signal, req: object, size: int, protocol: str = "") -> AcceptResult:
        """Queue ``req``'s line and wait until its signal's writer has written and fsync-ed it (or failed)."""
        writer, queue = self._writers[signal.name], self._queues[signal.name]
        received = "spans_received" if signal is TRACES else "metric_points_received"
        with self._state_lock:
            stopping = self._stopping
        if stopping or not writer.alive:
            self._stats.add(refused_stopping=1)
            return AcceptResult(None, message="receiver is shutting down; retry against the next one")
        rejected = signal.drop_invalid(req)
        spans = signal.items(req)
        if spans == 0:  # nothing to keep: answer success without writing an empty line
            self._stats.add(spans_rejected=rejected, **{f"{protocol}_requests": 1})
            return AcceptResult(signal.response(rejected))
        line = signal.to_line(req)
        if len(line) > self._max_line_bytes:
            self._stats.add(too_large=1)
            return AcceptResult(None, too_large=True, message=(
                f"request is {len(line)} bytes as an OTLP/JSON line, over the {self._max_line_bytes} the loader "
                "reads; export smaller batches"))
        pending = PendingWrite(line, spans)
        if not queue.offer(pending, len(line)):
            self._stats.add(refused_full=1)
            return AcceptResult(None, queue_full=True, message="write queue full; retry later")
        outcome = pending.wait(self._ack_timeout_s)
        if outcome == "in progress":  # the writer holds it: it will be written or fail soon
            outcome = pending.wait(self._ack_timeout_s)
        if outcome is None:
            self._stats.add(spans_rejected=rejected, **{received: spans, f"{protocol}_requests": 1})
            return AcceptResult(signal.response(rejected))
        if outcome.startswith("failed"):  # counted by the writer as write_errors
            return AcceptResult(None, message=f"{outcome.removeprefix('failed: ')}; retry later")
        self._stats.add(refused_timeout=1)
        return AcceptResult(None, message=f"write not confirmed within {self._ack_timeout_s:g} s ({outcome}); retry")

    def _malformed_grpc(self) -> None:
        self._stats.add(malformed_grpc=1)

    def _malformed_http(self) -> None:
        self._stats.add(malformed_http=1)
