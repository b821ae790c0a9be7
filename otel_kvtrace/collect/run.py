"""``collect()``: run a ``Receiver`` in the foreground until SIGINT/SIGTERM (what ``kvtrace collect`` calls)."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType

from otel_kvtrace.collect.bind import is_loopback
from otel_kvtrace.collect.receiver import (
    DEFAULT_GRPC_PORT,
    DEFAULT_HOST,
    DEFAULT_HTTP_PORT,
    DEFAULT_MAX_QUEUE_BYTES,
    DEFAULT_OUT_DIR,
    Receiver,
)
from otel_kvtrace.collect.stats import ReceiverStats


def _print_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def collect(
    out: str | os.PathLike[str] = DEFAULT_OUT_DIR,
    grpc_port: int | None = DEFAULT_GRPC_PORT,
    http_port: int | None = DEFAULT_HTTP_PORT,
    host: str = DEFAULT_HOST,
    max_queue_bytes: int = DEFAULT_MAX_QUEUE_BYTES,
    allow_remote: bool = False,
    status_interval: float = 10.0,
    stop_event: threading.Event | None = None,
    progress: Callable[[str], None] = _print_stderr,
) -> ReceiverStats:
    """Receive OTLP traces and metrics until SIGINT/SIGTERM (or ``stop_event``), write them, return the final counts.

    Prints where it listens and writes, then the counts every ``status_interval`` seconds when they
    changed (0 turns that off), and the final counts on exit. Raises ``PortInUseError`` when a port is taken,
    ``HostError`` when ``host`` is empty, does not resolve, or is not loopback without ``allow_remote``.
    """
    stop = stop_event or threading.Event()
    receiver = Receiver(out, grpc_port=grpc_port, http_port=http_port, host=host, max_queue_bytes=max_queue_bytes,
                        allow_remote=allow_remote)
    if not is_loopback(receiver.host):
        progress(f"kvtrace collect: WARNING: listening on {receiver.host}, reachable from the network; the receiver "
                 "has no authentication and anyone who can connect can add traces to your reports")
    receiver.start()
    previous: dict[signal.Signals, object] = {}
    try:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                previous[signum] = signal.signal(signum, lambda s, f: _request_stop(stop, s, f))
        endpoints = []
        if receiver.grpc_port is not None:
            endpoints.append(f"grpc {receiver.host}:{receiver.grpc_port}")
        if receiver.http_port is not None:
            endpoints.append(f"http {receiver.host}:{receiver.http_port}/v1/traces")
        progress(f"kvtrace collect: listening on {', '.join(endpoints)}; writing {receiver.path}")
        progress(f"kvtrace collect: metrics (gRPC MetricsService, POST /v1/metrics) go to {receiver.metrics_path}")
        last = receiver.stats()
        while not stop.wait(status_interval if status_interval > 0 else None):
            now = receiver.stats()
            if now != last:
                progress(f"kvtrace collect: {now.summary()}")
                last = now
    finally:
        progress("kvtrace collect: stopping, writing what was received ...")
        stats = receiver.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
    progress(f"kvtrace collect: {stats.summary()}")
    return stats


def _request_stop(stop: threading.Event, signum: int, frame: FrameType | None) -> None:
    stop.set()
