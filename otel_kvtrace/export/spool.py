"""The delivery spool: a bounded directory of export batches not yet acknowledged by the OTLP receiver.

Each batch is one OTLP/JSON line (the file sink's format) in its own file, ``{seq:012d}-t{tasks}.jsonl``,
written to a temporary name and renamed, so a reader (the sender thread, ``kvtrace resend``) never sees
half a batch and a process that dies leaves only whole batches. ``spool.json`` next to them names the
endpoint and protocol they were meant for. When the directory would exceed its cap, the oldest batches
are deleted and their tasks counted as dropped: the only place where delivery drops anything.

A writing process holds an exclusive ``flock`` on ``spool.lock`` while it lives (the kernel releases it
when the process dies, however it dies), so ``kvtrace resend`` never sends the spool of a running process.

Files are not fsync'ed: the spool survives the death of the process, not the loss of the machine.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

META_FILE = "spool.json"
LOCK_FILE = "spool.lock"


class SpoolBusy(OSError):
    """Another live process holds the spool (its sink, or a running ``kvtrace resend``)."""
_BATCH_NAME = re.compile(r"^(\d{12})-t(\d+)\.jsonl$")


@dataclass(slots=True)
class SpoolEntry:
    """One spooled batch."""

    seq: int
    path: Path
    tasks: int
    size: int


def batch_name(seq: int, tasks: int) -> str:
    return f"{seq:012d}-t{tasks}.jsonl"


def is_spool_dir(path: Path) -> bool:
    """True for a directory written by :class:`Spool` (it holds ``spool.json``)."""
    return (path / META_FILE).is_file()


def read_meta(directory: Path) -> dict[str, Any]:
    """The endpoint/protocol a spool was written for (empty when unreadable)."""
    try:
        meta = json.loads((directory / META_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


class Spool:
    """Bounded, ordered, crash-safe store of batches; thread-safe (one writer, one sender).

    ``put`` is called by the exporter, ``claim``/``done``/``replace``/``release`` by the sender. A
    batch claimed by the sender is never evicted under it (its bytes still count toward the cap).
    """

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int, meta: dict[str, Any] | None = None,
                 *, lock: bool = False) -> None:
        """``lock``: take the directory's lock first (raises :class:`SpoolBusy` when a live process has it)."""
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[int, SpoolEntry] = OrderedDict()
        self._claimed: set[int] = set()
        self._skipped: set[int] = set()  # rejected by the receiver: kept on disk, not retried here
        self.bytes = 0
        self._tasks = 0  # sum of the entries' tasks, kept so ``tasks`` is O(1)
        self.evicted_tasks = 0
        self.evicted_batches = 0
        self._lock_fd: int | None = None
        self.directory.mkdir(parents=True, exist_ok=True)
        if lock:
            self._take_lock()
        if meta is not None:
            tmp = self.directory / f".{META_FILE}.tmp"
            tmp.write_text(json.dumps(meta, sort_keys=True))
            os.replace(tmp, self.directory / META_FILE)
        self._adopt()
        self._next_seq = (max(self._entries) + 1) if self._entries else 0

    def _adopt(self) -> None:
        """Pick up whole batches already in the directory (a resend, or a restart under the same name)."""
        for path in sorted(self.directory.iterdir()):
            m = _BATCH_NAME.match(path.name)
            if m is None:
                continue
            entry = SpoolEntry(int(m.group(1)), path, int(m.group(2)), path.stat().st_size)
            self._entries[entry.seq] = entry
            self.bytes += entry.size
            self._tasks += entry.tasks

    def _take_lock(self) -> None:
        fd = os.open(self.directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            meta = read_meta(self.directory)
            raise SpoolBusy(f"{self.directory}: in use by a running process (pid {meta.get('pid', '?')} wrote it)") from None
        self._lock_fd = fd
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: (spool := ref()) is not None and spool.forget_lock())

    def close(self) -> None:
        """Release the directory's lock (the batches stay). Idempotent."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)  # closing the only descriptor releases the flock

    def forget_lock(self) -> None:
        """In a forked child: drop the inherited descriptor without unlocking (the parent keeps its lock
        until it exits or closes, the child does not prolong it)."""
        self.close()

    # ---- writer ---------------------------------------------------------------------------------
    def put(self, line: bytes, tasks: int) -> bool:
        """Store one batch; evict the oldest unclaimed batches to make room. False if it cannot fit.

        Raises ``OSError`` when the file cannot be written (the caller counts the batch as lost).
        """
        size = len(line)
        with self._lock:
            if not self._make_room(size):
                return False
            seq = self._next_seq
            self._next_seq += 1
            self.bytes += size  # reserved now, so concurrent puts cannot overshoot the cap
        path = self.directory / batch_name(seq, tasks)
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            with open(tmp, "wb") as fh:
                fh.write(line)
            os.replace(tmp, path)
        except OSError:
            with self._lock:
                self.bytes -= size
            raise
        with self._lock:
            self._entries[seq] = SpoolEntry(seq, path, tasks, size)
            self._tasks += tasks
        return True

    def _make_room(self, size: int) -> bool:
        """Evict the oldest unclaimed batches until ``size`` more bytes fit; O(evicted + claimed), no copy."""
        if size > self.max_bytes:
            return False
        if self.bytes + size <= self.max_bytes:
            return True
        victims: list[int] = []
        freed = 0
        for seq, entry in self._entries.items():  # oldest first
            if self.bytes - freed + size <= self.max_bytes:
                break
            if seq not in self._claimed:
                victims.append(seq)
                freed += entry.size
        for seq in victims:
            entry = self._entries.pop(seq)
            self._skipped.discard(seq)
            self._unlink(entry.path)
            self.bytes -= entry.size
            self._tasks -= entry.tasks
            self.evicted_tasks += entry.tasks
            self.evicted_batches += 1
        return self.bytes + size <= self.max_bytes

    # ---- sender ---------------------------------------------------------------------------------
    def claim(self, max_bytes: int = 0) -> list[SpoolEntry]:
        """The oldest batches not yet rejected, reserved for the sender: the first one, plus the next
        ones while their total size stays within ``max_bytes`` (one request for several small batches)."""
        out: list[SpoolEntry] = []
        total = 0
        max_bytes = min(max_bytes, self.max_bytes // 4)  # claimed batches cannot be evicted: keep it small
        with self._lock:
            for seq, entry in self._entries.items():
                if seq in self._skipped or seq in self._claimed:
                    continue
                if out and total + entry.size > max_bytes:
                    break
                out.append(entry)
                total += entry.size
            self._claimed.update(e.seq for e in out)
        return out

    def release(self, entry: SpoolEntry, *, rejected: bool = False) -> None:
        """Give a claimed batch back (still undelivered); ``rejected`` stops the sender retrying it."""
        with self._lock:
            self._claimed.discard(entry.seq)
            if rejected and entry.seq in self._entries:
                self._skipped.add(entry.seq)

    def release_claimed(self) -> None:
        """Give every claimed batch back (the sender's step failed half-way)."""
        with self._lock:
            self._claimed.clear()

    def done(self, entry: SpoolEntry) -> None:
        """The receiver acknowledged the whole batch: delete it."""
        with self._lock:
            self._claimed.discard(entry.seq)
            gone = self._entries.pop(entry.seq, None)
            if gone is not None:
                self.bytes -= gone.size
                self._tasks -= gone.tasks
        self._unlink(entry.path)

    def replace(self, entry: SpoolEntry, line: bytes, tasks: int) -> SpoolEntry:
        """Keep only the undelivered remainder of a partly delivered batch (same place in the order)."""
        path = self.directory / batch_name(entry.seq, tasks)
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "wb") as fh:
            fh.write(line)
        os.replace(tmp, path)
        if path != entry.path:
            self._unlink(entry.path)
        new = SpoolEntry(entry.seq, path, tasks, len(line))
        with self._lock:
            old = self._entries.get(entry.seq)
            if old is not None:
                self._entries[entry.seq] = new
                self.bytes += new.size - old.size
                self._tasks += new.tasks - old.tasks
        return new

    # ---- state ----------------------------------------------------------------------------------
    @property
    def tasks(self) -> int:
        """Tasks on disk, not yet acknowledged (including batches the receiver rejected)."""
        return self._tasks

    @property
    def batches(self) -> int:
        with self._lock:
            return len(self._entries)

    @property
    def sendable(self) -> int:
        """Batches the sender would still try."""
        with self._lock:
            return len(self._entries) - len(self._skipped)

    def remove_if_empty(self) -> bool:
        """Delete the directory when nothing is left in it but the metadata. True if removed."""
        with self._lock:
            if self._entries:
                return False
        try:
            (self.directory / META_FILE).unlink(missing_ok=True)
            (self.directory / LOCK_FILE).unlink(missing_ok=True)
            self.close()
            self.directory.rmdir()
        except OSError:
            return False
        return True

    @staticmethod
    def _unlink(path: Path) -> None:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
