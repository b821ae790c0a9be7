"""The single thread that turns queued requests into OTLP/JSON lines in the output file."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import BinaryIO

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
)

from otel_kvtrace.collect.queue import ByteBoundedQueue
from otel_kvtrace.collect.stats import StatsCounter
from otel_kvtrace.collect.validate import count_spans
from otel_kvtrace.export.otlp_json import request_to_json_line

_log = logging.getLogger(__name__)


class JsonLinesWriter:
    """Drains the queue into ``path`` (opened for append, so a restart never truncates earlier data).

    It flushes whenever the queue runs empty, so readers see data within one request of idle time,
    and at ``stop`` it writes everything still queued before closing the file.
    """

    def __init__(self, path: Path, queue: ByteBoundedQueue[ExportTraceServiceRequest], stats: StatsCounter) -> None:
        self.path = path
        self._queue = queue
        self._stats = stats
        self._file: BinaryIO | None = None
        self._thread = threading.Thread(target=self._run, name="kvtrace-collect-writer", daemon=True)

    def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "ab")  # noqa: SIM115 - closed by the writer thread at stop
        self._thread.start()

    def stop(self, timeout: float | None = None) -> bool:
        """Close the queue, wait until every queued request is written and the file closed; False on timeout."""
        self._queue.close()
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        assert self._file is not None
        dirty = False
        try:
            while True:
                req = self._queue.take(timeout=0.2)
                if req is None:
                    if dirty:
                        self._file.flush()
                        dirty = False
                    if self._queue.closed and len(self._queue) == 0:
                        return
                    continue
                try:
                    line = request_to_json_line(req)
                    self._file.write(line)
                except Exception:  # noqa: BLE001 - one bad request must not stop the writer
                    _log.exception("kvtrace collect: could not write a request to %s", self.path)
                    self._stats.add(write_errors=1)
                    continue
                dirty = True
                self._stats.add(lines_written=1, spans_written=count_spans(req))
                if len(self._queue) == 0:
                    self._file.flush()
                    dirty = False
        finally:
            self._file.close()
