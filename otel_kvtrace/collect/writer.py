"""The single thread that appends queued OTLP/JSON lines to the output file and acknowledges them.

Durability policy (docs/collector.md): a sender is answered success only after its line was written and
``fsync``-ed. The writer takes every line waiting at once (group commit), writes them with ``os.write``,
calls ``fsync`` once for the batch, then wakes their senders. When the write or the ``fsync`` fails
(disk full, file system gone) the file is truncated back to the last acknowledged byte, so no partial
line is left, the batch's senders are answered a retryable error, and the writer keeps running: the
next batch tries again (space may have been freed).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from pathlib import Path

from otel_kvtrace.collect.queue import ByteBoundedQueue
from otel_kvtrace.collect.stats import StatsCounter

_log = logging.getLogger(__name__)
_MAX_BATCH = 256

_PENDING, _TAKEN, _WRITTEN, _FAILED, _CANCELLED = range(5)


class PendingWrite:
    """One request's line on its way to the file; its sender waits on ``wait``."""

    __slots__ = ("line", "spans", "_state", "error", "_cond")  # spans: the line's items (spans or points)

    def __init__(self, line: bytes, spans: int) -> None:
        self.line = line
        self.spans = spans
        self._state = _PENDING
        self.error = ""
        self._cond = threading.Condition(threading.Lock())

    def wait(self, timeout: float) -> str | None:
        """None once written; else why not: ``"failed: ..."``, ``"timeout"`` (not written, will not be),
        or ``"in progress"`` (the writer holds it: it may still be written, a retry may duplicate it)."""
        with self._cond:
            self._cond.wait_for(lambda: self._state in (_WRITTEN, _FAILED), timeout)
            if self._state == _WRITTEN:
                return None
            if self._state == _FAILED:
                return f"failed: {self.error}"
            if self._state == _PENDING:
                self._state = _CANCELLED  # the writer will skip it
                return "timeout"
            return "in progress"

    def _take(self) -> bool:
        with self._cond:
            if self._state != _PENDING:
                return False
            self._state = _TAKEN
            return True

    def _finish(self, error: str | None) -> None:
        with self._cond:
            self._state = _WRITTEN if error is None else _FAILED
            self.error = error or ""
            self._cond.notify_all()


class JsonLinesWriter:
    """Appends acknowledged lines to ``path``; the file is created on the first line (an idle receiver
    leaves no empty file) and opened for append, so a restart never truncates earlier data."""

    def __init__(self, path: Path, queue: ByteBoundedQueue[PendingWrite], stats: StatsCounter,
                 fsync: bool = True, items_counter: str = "spans_written") -> None:
        self.path = path
        self._items_counter = items_counter
        self._queue = queue
        self._stats = stats
        self._fsync = fsync
        self._fd: int | None = None
        self._good_size = 0
        self._thread = threading.Thread(target=self._run, name="kvtrace-collect-writer", daemon=True)

    def start(self) -> None:
        """Create the directory and check it is writable (the file itself comes with the first line)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists() and not os.access(self.path, os.W_OK):
            raise PermissionError(f"{self.path} is not writable")
        if not os.access(self.path.parent, os.W_OK | os.X_OK):
            raise PermissionError(f"{self.path.parent} is not writable")
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float | None = None) -> bool:
        """Close the queue, wait until every queued line is written and the file closed; False on timeout."""
        self._queue.close()
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:
            while True:
                batch = [p for p in self._queue.take_many(0.2, _MAX_BATCH) if p._take()]
                if batch:
                    self._commit(batch)
                elif self._queue.closed and len(self._queue) == 0:
                    return
        finally:
            if self._fd is not None:
                os.close(self._fd)

    def _commit(self, batch: list[PendingWrite]) -> None:
        try:
            self._write_all(b"".join(p.line for p in batch))
        except OSError as exc:
            error = f"cannot write {self.path}: {exc.strerror or exc}"
            _log.error("kvtrace collect: %s; %d request(s) answered retry-later", error, len(batch))
            self._rollback()
            self._stats.add(write_errors=len(batch))
            for p in batch:
                p._finish(error)
            return
        self._stats.add(lines_written=len(batch), **{self._items_counter: sum(p.spans for p in batch)})
        for p in batch:
            p._finish(None)

    def _write_all(self, data: bytes) -> None:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            self._good_size = os.fstat(self._fd).st_size
            self._sync(os.open(self.path.parent, os.O_RDONLY), close=True)  # the new name is durable too
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view):]
        self._sync(self._fd)
        self._good_size += len(data)

    def _sync(self, fd: int, close: bool = False) -> None:
        try:
            if self._fsync:
                os.fsync(fd)
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # a pipe or character device cannot be synced; nothing to do
                raise
        finally:
            if close:
                os.close(fd)

    def _rollback(self) -> None:
        """Cut a partly written batch off, so the file ends at the last acknowledged line."""
        if self._fd is None:
            return
        try:
            if os.fstat(self._fd).st_size > self._good_size:
                os.ftruncate(self._fd, self._good_size)
        except OSError as exc:  # a pipe cannot be truncated; a vanished file system cannot either
            if exc.errno not in (errno.EINVAL, errno.ESPIPE):
                _log.error("kvtrace collect: cannot truncate %s after a failed write: %s", self.path, exc)
