"""Importers for msServiceProfiler outputs (formats: research §1; units: ``units.FORMAT_UNITS``).

- ``chrome_tracing.json``: a bare JSON array; ``ts``/``dur`` µs (floats or numeric strings).
- ``profiler.db`` and raw ``ms_service_<host>-<pid>.db``: table ``slice`` (``timestamp``/``duration`` ns,
  ``cat`` = domain, ``args`` = JSON); pid from ``slice.pid`` or ``thread`` via ``track_id``.
- MSPTI ``ascend_service_profiler_<host>-<pid>.db``: tables ``Communication`` and ``Kernel`` (ns).
- ``forward.csv`` (epoch ms) and ``batch.csv`` (labelled ms, epoch µs in practice).
- A vLLM symbols file (``service_profiling_symbols*.yaml``): checked for NPU-synchronising hooks.

Malformed rows are skipped and reported with file and line (JSON: the line the event starts on;
SQLite: the row id).
"""

from __future__ import annotations

import csv
import json
import re
import sqlite3
from decimal import Decimal
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from otel_kvtrace.asynccheck import model as m
from otel_kvtrace.asynccheck.classify import SYNC_HOOK_HANDLERS, canonical, markers_of
from otel_kvtrace.asynccheck.units import FORMAT_UNITS, epoch_unit, parse_number, to_ns

CAPTURE_LANE = "capture"


class _Sink:
    """Accumulates one file's rows."""

    def __init__(self, run: str, file: Path) -> None:
        self.run = run
        self.file = str(file)
        self.result = m.ImportResult()
        self.marker_counts: Counter[str] = Counter()

    def issue(self, line: int, reason: str) -> None:
        self.result.issues.append(m.ImportIssue(self.run, self.file, line, reason))

    def warn(self, kind: str, message: str) -> None:
        self.result.warnings.append(m.CaptureWarning(self.run, self.file, kind, message))

    def span(self, name: str, args: dict[str, Any], start_ns: int, end_ns: int, pid: Any, track: str = "") -> None:
        for marker in markers_of(name, args):
            self.marker_counts[marker] += 1
        domain = track.split("(")[0]
        self.result.seen.add(name)
        if domain:
            self.result.seen.add(f"domain:{domain}")
        canon, origin = canonical(name, args, track)
        if canon is not None:
            self.result.spans.append(
                m.SpanRow(self.run, self.file, CAPTURE_LANE, None, canon, origin, start_ns, end_ns, {"pid": pid})
            )

    def finish(self) -> m.ImportResult:
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
        yield line, obj
        line += text.count("\n", pos, end)
        pos = end


def import_chrome_tracing(path: Path, run: str) -> m.ImportResult:
    sink = _Sink(run, path)
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("{"):
        doc = json.loads(text, parse_float=Decimal)
        if not isinstance(doc.get("traceEvents"), list):
            sink.warn("unsupported_file", f"{path.name}: a JSON object without traceEvents; nothing imported")
            return sink.finish()
        events: Iterator[tuple[int, Any]] = iter(enumerate(doc["traceEvents"], 1))
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
    except (TypeError, ValueError):
        sink.issue(line, f"event {name!r}: ts/dur not numeric ({ev.get('ts')!r}, {ev.get('dur')!r})")
        return
    if dur < 0:
        sink.issue(line, f"event {name!r}: negative dur")
        return
    args = ev.get("args") if isinstance(ev.get("args"), dict) else {}
    sink.span(name, args, start, start + dur, ev.get("pid"), str(ev.get("tid", "")))


# ---- SQLite: slice tables and MSPTI ----------------------------------------------------------------------
def import_sqlite(path: Path, run: str) -> m.ImportResult:
    sink = _Sink(run, path)
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type IN ('table','view')")}
        if "slice" in tables:
            _import_slice(con, sink, tables)
        if "Communication" in tables:
            _import_mspti(con, sink, "Communication", "communication")
        if "Kernel" in tables:
            _import_mspti(con, sink, "Kernel", "Kernel")
        if not tables & {"slice", "Communication", "Kernel"}:
            kind = "legacy Mstx table" if "Mstx" in tables else "no slice/Communication/Kernel table"
            sink.warn("unsupported_db", f"{path.name}: {kind}; nothing imported")
    finally:
        con.close()
    return sink.finish()


def _columns(con: sqlite3.Connection, table: str) -> set[str]:
    return {r[1] for r in con.execute(f"PRAGMA table_info({table})")}


def _import_slice(con: sqlite3.Connection, sink: _Sink, tables: set[str]) -> None:
    cols = _columns(con, "slice")
    pid_expr = "s.pid" if "pid" in cols else ("t.pid" if "thread" in tables else "NULL")
    tid_expr = "t.thread_name" if "thread" in tables else ("s.tid" if "tid" in cols else "''")
    join = "LEFT JOIN thread t ON t.track_id = s.track_id" if "thread" in tables else ""
    rows = con.execute(
        f"SELECT s.id, s.timestamp, s.duration, s.name, s.cat, s.args, {pid_expr}, {tid_expr} "
        f"FROM slice s {join} ORDER BY s.id"
    )
    for row_id, ts, dur, name, cat, args_text, pid, thread_name in rows:
        if not isinstance(ts, int) or not isinstance(dur or 0, int) or (dur or 0) < 0:
            sink.issue(row_id, f"slice {name!r}: timestamp/duration not non-negative integers ({ts!r}, {dur!r})")
            continue
        try:
            args = json.loads(args_text) if args_text else {}
        except json.JSONDecodeError:
            sink.issue(row_id, f"slice {name!r}: args is not JSON")
            continue
        if not isinstance(name, str) or not name:
            sink.issue(row_id, "slice has no name")
            continue
        track = str(thread_name or cat or "")
        if cat and not track.startswith(str(cat)):
            track = f"{cat}({thread_name})"
        sink.span(name, args if isinstance(args, dict) else {}, ts, ts + (dur or 0), pid, track)


def _import_mspti(con: sqlite3.Connection, sink: _Sink, table: str, track: str) -> None:
    match = re.search(r"-(\d+)\.db$", sink.file)
    pid = int(match.group(1)) if match else None
    for row_id, name, start, end in con.execute(f"SELECT rowid, name, start, \"end\" FROM {table} ORDER BY rowid"):
        if not isinstance(start, int) or not isinstance(end, int) or end < start:
            sink.issue(row_id, f"{table} {name!r}: start/end not integers with end >= start ({start!r}, {end!r})")
            continue
        name = str(name or table)
        if table == "Communication":
            sink.result.spans.append(
                m.SpanRow(sink.run, sink.file, CAPTURE_LANE, None, m.COMMUNICATION, name, start, end, {"pid": pid})
            )
        else:
            sink.span(name, {}, start, end, pid, track)


# ---- CSV ------------------------------------------------------------------------------------------------
def import_csv(path: Path, run: str) -> m.ImportResult:
    sink = _Sink(run, path)
    with path.open(newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        header = reader.fieldnames or []
        if "forward_iter" in header or path.name.startswith("forward"):
            fmt = "forward_csv"
        elif "res_list" in header or path.name.startswith("batch"):
            fmt = "batch_csv"
        else:
            sink.warn("unsupported_csv", f"{path.name}: neither forward.csv nor batch.csv columns; nothing imported")
            return sink.finish()
        missing = {"name", "start_time(ms)", "end_time(ms)"} - set(header)
        if missing:
            sink.issue(1, f"missing columns: {', '.join(sorted(missing))}")
            return sink.finish()
        sink.result.seen.add(f"format:{fmt}")
        corrected: dict[str, int] = {}
        for row in reader:
            _csv_row(sink, fmt, reader.line_num, row, corrected)
    for unit, count in corrected.items():
        sink.warn(
            m.WARN_UNIT_GUESS,
            f"{path.name}: start_time(ms)/end_time(ms) read as {unit}, not ms, in {count} rows "
            f"(epoch magnitude, else the {fmt} convention {FORMAT_UNITS[fmt]})",
        )
    return sink.finish()


def _csv_row(sink: _Sink, fmt: str, line: int, row: dict[str, Any], corrected: dict[str, int]) -> None:
    name = (row.get("name") or "").strip()
    try:
        start_v, end_v = parse_number(row["start_time(ms)"]), parse_number(row["end_time(ms)"])
    except (TypeError, ValueError, KeyError):
        sink.issue(line, f"{name or 'row'}: start_time(ms)/end_time(ms) not numeric")
        return
    unit = epoch_unit(start_v) or FORMAT_UNITS[fmt]
    if unit != "ms":
        corrected[unit] = corrected.get(unit, 0) + 1
    start, end = to_ns(start_v, unit), to_ns(end_v, unit)
    if not name or end < start:
        sink.issue(line, f"{name or 'row'}: empty name or end before start")
        return
    args = {"async": row.get("async")} if row.get("async") else {}
    sink.span(name, args, start, end, row.get("prof_id") or None)


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
