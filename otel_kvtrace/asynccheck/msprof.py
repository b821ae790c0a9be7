"""Importers for msServiceProfiler outputs; each schema is taken from the writer's code (docs/async_check.md
"Where each schema comes from" names the repository and path for every file).

- ``chrome_tracing.json``: a bare JSON array (a ``{"traceEvents": [...]}`` object in 2024 outputs); ``ts``/
  ``dur`` µs (floats or numeric strings); ``pid`` int; ``tid`` ``"<domain>(<os tid>)"`` or ``Api``/``Kernel``.
- ``profiler.db``: table ``slice`` (``timestamp``/``duration`` ns) joined to ``thread`` (``pid`` TEXT).
- raw ``ms_service_<host>-<pid>.db``: ``slice`` with ``pid``/``tid`` columns (current) or ``Mstx``
  (``message, flag, markId, timestamp, endTimestamp, pid, tid``; older generations).
- MSPTI ``ascend_service_profiler_<host>-<pid>.db`` (older: ``..._<pid>.db``): ``Api``, ``Kernel``,
  ``Communication`` (ns, ``correlationId``).
- ``forward.csv``/``batch.csv``: ``start_time(ms)``/``end_time(ms)`` numbers (current parser), or ``start_time``/
  ``end_time`` as Asia/Shanghai ``%Y-%m-%d %H:%M:%S:%f`` strings (parser up to 2025-12).
- A vLLM symbols file (``service_profiling_symbols*.yaml``): checked for NPU-synchronising hooks.

Every span carries ``pid`` (an int wherever the format allows), ``source`` (the file kind, so the same span
read from several files of one capture is kept once: ``steps.dedup_sources``) and ``raw`` (its own name).
Malformed rows are skipped and reported with file and line (JSON: the line the event starts on;
SQLite: the row id; CSV: the line).
"""

from __future__ import annotations

import csv
import json
import re
import shutil
import sqlite3
import tempfile
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

from otel_kvtrace.asynccheck import model as m
from otel_kvtrace.asynccheck.classify import SYNC_HOOK_HANDLERS, canonical, markers_of
from otel_kvtrace.asynccheck.units import FORMAT_UNITS, epoch_unit, parse_number, time_problem, to_ns

CAPTURE_LANE = "capture"
SHANGHAI = timezone(timedelta(hours=8))
"""The older parser writes CSV times in Asia/Shanghai (UTC+8, no DST since 1991)."""
DATETIME_FORMAT = "%Y-%m-%d %H:%M:%S:%f"
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_TRAILING_PID = re.compile(r"-(\d+)$")
_MSPTI_PID = re.compile(r"^ascend_service_profiler_(?:.*-)?(\d+)\.db$")


def norm_pid(value: Any) -> int | str | None:
    """One pid form across files: int in chrome/raw DBs, text in profiler.db, ``ms_service_<host>-<pid>`` in CSVs."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int) and -(2**63) <= value < 2**63:
        return value
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        return int(value)
    text = str(value).strip()[:200]
    match = _TRAILING_PID.search(text) or re.fullmatch(r"(\d+)", text)
    if match and len(match.group(1)) <= 18:
        return int(match.group(1))
    return text or None


def batch_size_of(args: dict[str, Any]) -> int | None:
    """The batch's request count: ``batch_size`` (MindIE attr; the parser's chrome args), else the ``rid`` list."""
    size = args.get("batch_size")
    if isinstance(size, (int, float)) and not isinstance(size, bool) and 0 <= size < 10**7:
        return int(size)
    rids = args.get("rid")
    return len(rids) if isinstance(rids, list) else None


def source_kind(path: Path) -> str:
    """Which file of a capture ``path`` is (see ``classify.SOURCE_PRIORITY``)."""
    name = path.name
    if name.startswith("ascend_service_profiler_"):
        return "mspti_db"
    if name.startswith("ms_service_") and name.endswith(".db"):
        return "raw_db"
    if name.endswith(".db"):
        return "profiler_db"
    if name.endswith(".json"):
        return "chrome"
    if name.startswith(("batch", "forward")) and name.endswith(".csv"):
        return f"{name.split('.')[0].split('_')[0]}_csv"
    return "other"


class _Sink:
    """Accumulates one file's rows."""

    def __init__(self, run: str, file: Path, source: str | None = None) -> None:
        self.run = run
        self.file = str(file)
        self.source = source or source_kind(file)
        self.result = m.ImportResult()
        self.marker_counts: Counter[str] = Counter()
        self.lost_starts: dict[str, int] = {}

    def issue(self, line: int, reason: str) -> None:
        self.result.issues.append(m.ImportIssue(self.run, self.file, line, reason))

    def warn(self, kind: str, message: str) -> None:
        self.result.warnings.append(m.CaptureWarning(self.run, self.file, kind, message))

    def span(self, name: str, args: dict[str, Any], start_ns: int, end_ns: int, pid: Any, track: str = "",
             line: int = 0, extra: dict[str, Any] | None = None) -> None:
        problem = time_problem(start_ns, end_ns)
        if problem is not None and start_ns == 0 and time_problem(end_ns, end_ns) is None:
            # msServiceProfiler keeps span starts in a thread_local cache: a span ended on another thread
            # (current vLLM hooks end modelExec in a Future done-callback) is written with start 0
            self.lost_starts[name] = self.lost_starts.get(name, 0) + 1
            self.issue(line, f"{name!r}: start 0 (ended on another thread than it started)")
            return
        if problem is not None:
            self.issue(line, f"{name!r}: {problem}")
            return
        for marker in markers_of(name, args):
            self.marker_counts[marker] += 1
        domain = track.split("(")[0]
        self.result.seen.add(name)
        if domain:
            self.result.seen.add(f"domain:{domain}")
        canon, origin = canonical(name, args, track)
        if canon is not None:
            attrs = {"pid": norm_pid(pid), "source": self.source, "raw": name, **(extra or {})}
            if canon == m.BATCH_SCHEDULE:
                size = batch_size_of(args)
                if size is not None:
                    attrs["batch_size"] = size
            self.result.spans.append(
                m.SpanRow(self.run, self.file, CAPTURE_LANE, None, canon, origin, start_ns, end_ns, attrs)
            )

    def finish(self) -> m.ImportResult:
        for name, count in sorted(self.lost_starts.items()):
            self.result.seen.add(f"start_lost:{name}")
            self.warn(m.WARN_SPAN_START_LOST, f"{count} {name!r} spans have start 0: msServiceProfiler reads a span's "
                      "start from the ending thread's cache, and these ended on another thread (a Future "
                      "done-callback); the launch is taken from modelRunnerExec instead")
        self.result.markers += [m.Marker(self.run, self.file, k, v) for k, v in sorted(self.marker_counts.items())]
        return self.result


# ---- chrome_tracing.json -------------------------------------------------------------------------------
class _JsonSyntaxError(ValueError):
    def __init__(self, line: int, message: str) -> None:
        super().__init__(message)
        self.line = line


def _iter_json_array(text: str) -> Iterator[tuple[int, Any]]:
    """``(line, element)`` for each element of a top-level JSON array; raises ValueError on bad syntax."""
    decoder = json.JSONDecoder(parse_float=Decimal)
    pos = text.index("[") + 1 if text.lstrip().startswith("[") else -1
    if pos < 0:
        raise _JsonSyntaxError(1, "not a JSON array (chrome_tracing.json is a bare array)")
    line = 1 + text.count("\n", 0, pos)
    n = len(text)
    while True:
        start = pos
        while pos < n and text[pos] in " \t\r\n,":
            pos += 1
        line += text.count("\n", start, pos)
        if pos >= n:
            raise _JsonSyntaxError(line, "unterminated JSON array")
        if text[pos] == "]":
            return
        try:
            obj, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            raise _JsonSyntaxError(exc.lineno, f"JSON syntax error: {exc.msg}; the rest of the file is skipped") from exc
        except RecursionError as exc:
            raise _JsonSyntaxError(line, "JSON nested too deeply; the rest of the file is skipped") from exc
        yield line, obj
        line += text.count("\n", pos, end)
        pos = end


def import_chrome_tracing(path: Path, run: str) -> m.ImportResult:
    sink = _Sink(run, path, "chrome")
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("{"):
        doc = json.loads(text, parse_float=Decimal)
        events_list = doc.get("traceEvents") if isinstance(doc, dict) else None
        if not isinstance(events_list, list):
            sink.warn("unsupported_file", f"{path.name}: a JSON object without traceEvents; nothing imported")
            return sink.finish()
        events: Iterator[tuple[int, Any]] = iter(enumerate(events_list, 1))
    else:
        events = _iter_json_array(text)
    try:
        for line, ev in events:
            _chrome_event(sink, line, ev)
    except _JsonSyntaxError as exc:
        sink.issue(exc.line, str(exc))
    return sink.finish()


def _chrome_event(sink: _Sink, line: int, ev: Any) -> None:
    if not isinstance(ev, dict):
        sink.issue(line, "event is not a JSON object")
        return
    ph = ev.get("ph")
    if ph not in ("X", "I", "i"):
        return  # metadata, counters and flows carry no phase timing
    name = ev.get("name")
    if not isinstance(name, str) or not name:
        sink.issue(line, "event has no name")
        return
    try:
        start = to_ns(parse_number(ev.get("ts")), FORMAT_UNITS["chrome_tracing"])
        dur = to_ns(parse_number(ev.get("dur", 0)), FORMAT_UNITS["chrome_tracing"])
    except (TypeError, ValueError, ArithmeticError):
        sink.issue(line, f"event {name!r}: ts/dur not numeric ({str(ev.get('ts'))[:40]!r}, {str(ev.get('dur'))[:40]!r})")
        return
    if dur < 0:
        sink.issue(line, f"event {name!r}: negative dur")
        return
    args = ev.get("args") if isinstance(ev.get("args"), dict) else {}
    sink.span(name, args, start, start + dur, ev.get("pid"), str(ev.get("tid", "")), line)


# ---- SQLite: slice, Mstx and MSPTI tables -----------------------------------------------------------------
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
    sink = _Sink(run, path)
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


def _import_slice(con: sqlite3.Connection, sink: _Sink, tables: dict[str, str]) -> None:
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


def _import_mstx(con: sqlite3.Connection, sink: _Sink, table: str) -> None:
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


def _import_mspti(con: sqlite3.Connection, sink: _Sink, tables: dict[str, str]) -> None:
    """MSPTI rows keep their own names (the parser renames kernels after their Api) and their correlationId."""
    match = _MSPTI_PID.match(Path(sink.file).name)
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


# ---- CSV ------------------------------------------------------------------------------------------------
def datetime_ns(text: str) -> int:
    """Epoch ns of an older-parser CSV time ``%Y-%m-%d %H:%M:%S:%f`` written in Asia/Shanghai."""
    local = datetime.strptime(text.strip(), DATETIME_FORMAT).replace(tzinfo=SHANGHAI)
    return (local - _EPOCH) // timedelta(microseconds=1) * 1000


def _csv_rows(sink: _Sink, reader: csv.DictReader) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line, row)`` of every readable row; a row the csv module rejects is a named skip, not a lost file."""
    while True:
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            sink.issue(reader.line_num, f"CSV syntax: {exc}")
            continue
        yield reader.line_num, row


def _csv_format(path: Path, header: list[str]) -> str | None:
    if "http_rid" in header or path.name.startswith("request"):
        return "request_csv"
    if "forward_iter" in header or path.name.startswith("forward"):
        return "forward_csv"
    if "res_list" in header or path.name.startswith("batch"):
        return "batch_csv"
    return None


def import_csv(path: Path, run: str) -> m.ImportResult:
    with path.open(newline="", encoding="utf-8", errors="replace") as fh:
        reader = csv.DictReader(fh)
        header = reader.fieldnames or []
        fmt = _csv_format(path, header)
        sink = _Sink(run, path, fmt or "csv")
        if fmt is None:
            sink.warn("unsupported_csv", f"{path.name}: neither forward.csv nor batch.csv columns; nothing imported")
            return sink.finish()
        if fmt == "request_csv":
            _import_requests(sink, reader)
            return sink.finish()
        if {"start_time(ms)", "end_time(ms)"} <= set(header):
            columns, generation = ("start_time(ms)", "end_time(ms)"), "number"
        elif {"start_time", "end_time"} <= set(header):
            columns, generation = ("start_time", "end_time"), "datetime"  # parser up to 2025-12
        else:
            sink.issue(1, "missing columns: start_time(ms)/end_time(ms) (current parser) or start_time/end_time "
                          "(parser up to 2025-12)")
            return sink.finish()
        if "name" not in header:
            sink.issue(1, "missing column: name")
            return sink.finish()
        sink.result.seen.add(f"format:{fmt}")
        corrected: dict[str, int] = {}
        for line, row in _csv_rows(sink, reader):
            _csv_row(sink, fmt, line, row, columns, generation, corrected)
    for unit, count in corrected.items():
        sink.warn(
            m.WARN_UNIT_GUESS,
            f"{path.name}: start_time(ms)/end_time(ms) read as {unit}, not ms, in {count} rows "
            f"(epoch magnitude, else the {fmt} convention {FORMAT_UNITS[fmt]})",
        )
    return sink.finish()


def _csv_times(fmt: str, row: dict[str, Any], columns: tuple[str, str], generation: str,
               corrected: dict[str, int]) -> tuple[int, int]:
    start_text, end_text = row.get(columns[0]), row.get(columns[1])
    if not isinstance(start_text, str) or not isinstance(end_text, str):
        raise ValueError("missing value")
    if generation == "datetime" and ":" in start_text:
        return datetime_ns(start_text), datetime_ns(end_text)
    start_v, end_v = parse_number(start_text), parse_number(end_text)
    unit = epoch_unit(start_v) or FORMAT_UNITS[fmt]
    if unit != "ms":
        corrected[unit] = corrected.get(unit, 0) + 1
    return to_ns(start_v, unit), to_ns(end_v, unit)


def _csv_row(sink: _Sink, fmt: str, line: int, row: dict[str, Any], columns: tuple[str, str], generation: str,
             corrected: dict[str, int]) -> None:
    name = (row.get("name") or "").strip() if isinstance(row.get("name"), str) else ""
    try:
        start, end = _csv_times(fmt, row, columns, generation, corrected)
    except (TypeError, ValueError, ArithmeticError):
        sink.issue(line, f"{name[:60] or 'row'}: {columns[0]}/{columns[1]} not numbers or {DATETIME_FORMAT} times")
        return
    if not name:
        sink.issue(line, "row without a name")
        return
    args = {"async": row.get("async")} if row.get("async") else {}
    sink.span(name, args, start, end, row.get("prof_id") or None, line=line)


def _opt_number(row: dict[str, Any], column: str) -> Decimal | None:
    value = row.get(column)
    if value is None or (isinstance(value, str) and value.strip() in ("", "N/A", "nan")):
        return None
    return parse_number(value)


def _import_requests(sink: _Sink, reader: csv.DictReader) -> None:
    """request.csv (``exporters/exporter_req_data.py``): latencies in ms; start ``start_time(ms)`` (epoch ms,
    current parser) or ``start_datetime`` (both generations)."""
    sink.result.seen.add("format:request_csv")
    for line, row in _csv_rows(sink, reader):
        try:
            start_ms = _opt_number(row, "start_time(ms)")
            start = to_ns(start_ms, "ms") if start_ms is not None else (
                datetime_ns(row["start_datetime"]) if row.get("start_datetime") else None)
            latency, ttft, queue, out = (_opt_number(row, c) for c in (
                "execution_time(ms)", "first_token_latency(ms)", "queue_wait_time(ms)", "reply_token_size"))
        except (TypeError, ValueError, ArithmeticError):
            sink.issue(line, "request row: a time or token count is not a number")
            continue
        if start is not None and time_problem(start, start) is not None:
            sink.issue(line, f"request row: {time_problem(start, start)}")
            continue
        if any(v is not None and not 0 <= v < 10**10 for v in (latency, ttft, queue, out)):
            sink.issue(line, "request row: negative or absurd latency/token count")
            continue
        sink.result.requests.append(m.RequestRow(
            sink.run, sink.file, str(row.get("http_rid") or "")[:200], start,
            None if latency is None else float(latency), None if ttft is None else float(ttft),
            None if queue is None else float(queue), None if out is None else int(out),
        ))


# ---- vLLM symbols file ---------------------------------------------------------------------------------
def import_symbols_yaml(path: Path, run: str) -> m.ImportResult:
    """Warn when the msServiceProfiler vLLM symbol file enables the NPU-synchronising handlers."""
    sink = _Sink(run, path)
    text = path.read_text(encoding="utf-8")
    active = [h for h in SYNC_HOOK_HANDLERS if re.search(rf"^(?!\s*#).*\b{h}\b", text, re.MULTILINE)]
    if active:
        sink.warn(
            m.WARN_NPU_SYNC_HOOKS,
            f"{path.name} enables msServiceProfiler hooks that synchronize the NPU ({', '.join(active)}); "
            "device/host overlap cannot be judged from this capture. Remove them and collect again.",
        )
    return sink.finish()
