"""msServiceProfiler SQLite files: ``profiler.db`` and raw ``ms_service_<host>-<pid>.db`` (``slice`` or the
older ``Mstx``), MSPTI ``ascend_service_profiler_*.db`` (``Api``, ``Kernel``, ``Communication``); schemas and
their sources: ``msprof`` and docs/async_check.md. Opened read-only without writing next to the file."""

from __future__ import annotations

import json
import re
import shutil
import sqlite3
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from otel_kvtrace.asynccheck import model as m
from otel_kvtrace.asynccheck.msprof import CAPTURE_LANE, MSPTI_PID, Sink
from otel_kvtrace.asynccheck.units import time_problem


@contextmanager
def open_readonly(path: Path) -> Iterator[sqlite3.Connection]:
    """Open a capture DB without writing anything next to it.

    The writer and the parser leave their DBs in WAL mode; ``mode=ro`` then needs to create ``-shm`` and
    fails in a read-only folder, so the file is opened ``immutable=1``. A DB with a non-empty ``-wal`` (a
    writer that did not close) is copied with its WAL to a temporary folder first: ``immutable`` would
    ignore the WAL's rows. The URI comes from ``Path.as_uri()``, which percent-encodes ``#`` and ``?`` in
    names, so a file name cannot add URI parameters.
    """
    wal = path.with_name(path.name + "-wal")
    tmp: str | None = None
    try:
        if wal.is_file() and wal.stat().st_size > 0:
            tmp = tempfile.mkdtemp(prefix="kvtrace-db-")
            copy = Path(tmp) / "capture.db"
            shutil.copyfile(path, copy)
            shutil.copyfile(wal, Path(tmp) / "capture.db-wal")
            uri = copy.as_uri() + "?mode=ro"
        else:
            uri = path.resolve().as_uri() + "?immutable=1"
        con = sqlite3.connect(uri, uri=True)
        try:
            yield con
        finally:
            con.close()
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def import_sqlite(path: Path, run: str) -> m.ImportResult:
    sink = Sink(run, path)
    with open_readonly(path) as con:
        tables = {r[0].lower(): r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type IN ('table','view')")}
        if "slice" in tables:
            _import_slice(con, sink, tables)
        elif "mstx" in tables:
            _import_mstx(con, sink, tables["mstx"])
        mspti = [t for t in ("api", "kernel", "communication") if t in tables]
        if mspti:
            sink.source = "mspti_db"
            _import_mspti(con, sink, tables)
        if not ("slice" in tables or "mstx" in tables or mspti):
            sink.warn("unsupported_db", f"{path.name}: no slice/Mstx/Api/Kernel/Communication table; nothing imported")
    return sink.finish()


def _columns(con: sqlite3.Connection, table: str) -> set[str]:
    return {r[1] for r in con.execute(f'PRAGMA table_info("{table}")')}


def _load_args(text: Any) -> dict[str, Any] | None:
    """Span attributes: JSON (Python API) or the C++ ``^key^:^value^,`` form the parser repairs the same way."""
    if text is None or text == "":
        return {}
    if not isinstance(text, str):
        return None
    fixed = text.replace("^", '"')
    if not re.match(r"^\{.*\}$", fixed, re.DOTALL):
        fixed = "{" + re.sub(r",$", "", fixed) + "}"
    try:
        args = json.loads(fixed)
    except (ValueError, RecursionError):
        return None
    return args if isinstance(args, dict) else None


def _import_slice(con: sqlite3.Connection, sink: Sink, tables: dict[str, str]) -> None:
    cols = _columns(con, "slice")
    has_thread = "thread" in tables
    pid_expr = "s.pid" if "pid" in cols else ("t.pid" if has_thread else "NULL")
    tid_expr = "coalesce(t.thread_name, t.tid)" if has_thread else ("s.tid" if "tid" in cols else "''")
    join = "LEFT JOIN thread t ON t.track_id = s.track_id" if has_thread else ""
    rows = con.execute(
        f"SELECT s.id, s.timestamp, s.duration, s.name, s.cat, s.args, {pid_expr}, {tid_expr} "
        f"FROM slice s {join} ORDER BY s.id"
    )
    for row_id, ts, dur, name, cat, args_text, pid, thread_name in rows:
        if not isinstance(ts, int) or not isinstance(dur or 0, int) or (dur or 0) < 0:
            sink.issue(row_id, f"slice {str(name)[:60]!r}: timestamp/duration not non-negative integers")
            continue
        args = _load_args(args_text)
        if args is None:
            sink.issue(row_id, f"slice {str(name)[:60]!r}: args is not a JSON object")
            continue
        if not isinstance(name, str) or not name:
            sink.issue(row_id, "slice has no name")
            continue
        track = str(thread_name or cat or "")
        if cat and not track.startswith(str(cat)):
            track = f"{cat}({thread_name})"
        sink.span(name, args, ts, ts + (dur or 0), pid, track, row_id)


def _import_mstx(con: sqlite3.Connection, sink: Sink, table: str) -> None:
    """Older raw DBs: ``Mstx(message, flag, markId, timestamp, endTimestamp, pid, tid)``, name/domain in message."""
    order = "markId" if "markId" in _columns(con, table) else "rowid"
    rows = con.execute(f'SELECT rowid, message, timestamp, endTimestamp, pid, tid FROM "{table}" ORDER BY {order}')
    for row_id, message, ts, end, pid, tid in rows:
        args = _load_args(message)
        if args is None:
            sink.issue(row_id, "Mstx message is not a JSON object")
            continue
        name = args.get("name")
        if not isinstance(name, str) or not name:
            sink.issue(row_id, "Mstx message has no name")
            continue
        if not isinstance(ts, int) or not isinstance(end, int):
            sink.issue(row_id, f"Mstx {name[:60]!r}: timestamp/endTimestamp not integers")
            continue
        sink.span(name, args, ts, end, pid, f"{args.get('domain', '')}({tid})", row_id)


def _import_mspti(con: sqlite3.Connection, sink: Sink, tables: dict[str, str]) -> None:
    """MSPTI rows keep their own names (the parser renames kernels after their Api) and their correlationId."""
    match = MSPTI_PID.match(Path(sink.file).name)
    pid = int(match.group(1)) if match else None
    for key, track in (("api", "Api"), ("kernel", "Kernel"), ("communication", "Communication")):
        if key not in tables:
            continue
        cols = _columns(con, tables[key])
        corr = "correlationId" if "correlationId" in cols else "NULL"
        stream = "streamId" if "streamId" in cols else "NULL"
        rows = con.execute(
            f'SELECT rowid, name, start, "end", {corr}, {stream} FROM "{tables[key]}" ORDER BY start, rowid'
        )
        for row_id, name, start, end, corr_id, stream_id in rows:
            if not isinstance(start, int) or not isinstance(end, int):
                sink.issue(row_id, f"{track} {str(name)[:60]!r}: start/end not integers")
                continue
            name = str(name or track)
            extra = {"corr": corr_id, "stream": stream_id}
            if track == "Communication":
                problem = time_problem(start, end)
                if problem is not None:
                    sink.issue(row_id, f"{track} {name[:60]!r}: {problem}")
                    continue
                sink.result.spans.append(m.SpanRow(
                    sink.run, sink.file, CAPTURE_LANE, None, m.COMMUNICATION, name, start, end,
                    {"pid": pid, "source": sink.source, "raw": name, **extra},
                ))
            else:
                sink.span(name, {}, start, end, pid, track, row_id, extra)
