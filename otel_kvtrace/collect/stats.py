"""Counters of what the receiver accepted, refused and wrote; shared by the network and writer threads."""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass


@dataclass(slots=True)
class ReceiverStats:
    """A snapshot of the receiver's counters (all cumulative since ``start``)."""

    grpc_requests: int = 0
    """Export requests accepted over gRPC."""
    http_requests: int = 0
    """Export requests accepted over HTTP (protobuf or JSON)."""
    spans_received: int = 0
    """Spans in acknowledged requests (excluding rejected spans): written and fsync-ed before the answer."""
    metric_points_received: int = 0
    """Metric data points in acknowledged metrics requests: written and fsync-ed before the answer."""
    spans_rejected: int = 0
    """Spans dropped from accepted requests because a trace/span id had the wrong length (partial success)."""
    malformed_grpc: int = 0
    """gRPC requests that did not decode; answered INVALID_ARGUMENT."""
    malformed_http: int = 0
    """HTTP requests that were not valid OTLP (bad body, type, path, method, size); answered 4xx/501."""
    truncated_http: int = 0
    """HTTP bodies shorter than their Content-Length (the client went away); nothing of them is written."""
    too_large: int = 0
    """Requests whose OTLP/JSON line would exceed what the loader reads; answered 413 / INVALID_ARGUMENT."""
    refused_full: int = 0
    """Requests refused because the write queue was full; answered RESOURCE_EXHAUSTED / 503 (sender retries)."""
    refused_stopping: int = 0
    """Requests refused because the receiver was shutting down; answered UNAVAILABLE / 503."""
    refused_memory: int = 0
    """Requests refused because the bodies being decompressed at once used the memory budget; 503 (retry)."""
    refused_timeout: int = 0
    """Requests whose write was not confirmed within the acknowledgement timeout; UNAVAILABLE / 503."""
    internal_errors: int = 0
    """Requests that hit an unexpected error in the receiver (logged); answered 500 / INTERNAL."""
    lines_written: int = 0
    """JSON lines (one per accepted request) written to the output file."""
    spans_written: int = 0
    """Spans in the written lines."""
    metric_points_written: int = 0
    """Metric data points in the written lines (``metrics/otlp-metrics-collected-{pid}.jsonl``)."""
    write_errors: int = 0
    """Requests whose line could not be written or fsync-ed (disk full, ...); answered UNAVAILABLE / 503."""
    queue_high_water_bytes: int = 0
    """Largest amount of request bytes that waited for the writer at once."""

    def summary(self) -> str:
        """One human line for the terminal."""
        return (
            f"accepted {self.grpc_requests} grpc + {self.http_requests} http requests, "
            f"{self.spans_received} spans; wrote {self.lines_written} lines, {self.spans_written} spans; "
            f"malformed {self.malformed_grpc} grpc + {self.malformed_http} http; "
            f"+ {self.truncated_http} truncated + {self.too_large} too large; "
            f"refused {self.refused_full} (queue full) + {self.refused_stopping} (stopping) "
            f"+ {self.refused_memory} (memory) + {self.refused_timeout} (write timeout); "
            f"rejected spans {self.spans_rejected}; write errors {self.write_errors}; "
            f"internal errors {self.internal_errors}; "
            f"metric points: received {self.metric_points_received}, written {self.metric_points_written}"
        )


class StatsCounter:
    """Thread-safe increments into a ``ReceiverStats``; ``snapshot`` copies it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = ReceiverStats()

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + delta)

    def snapshot(self) -> ReceiverStats:
        with self._lock:
            return dataclasses.replace(self._stats)
