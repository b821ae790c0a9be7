"""msServiceProfiler CSVs: ``batch.csv``, ``forward.csv``, ``request.csv`` of both parser generations (current:
``start_time(ms)`` numbers; up to 2025-12: Asia/Shanghai date strings); sources: ``msprof`` and
docs/async_check.md. One bad row is a named skip."""

from __future__ import annotations

import csv
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

from otel_kvtrace.asynccheck import model as m
from otel_kvtrace.asynccheck.msprof import Sink
from otel_kvtrace.asynccheck.units import FORMAT_UNITS, epoch_unit, parse_number, time_problem, to_ns

SHANGHAI = timezone(timedelta(hours=8))
"""The older parser writes CSV times in Asia/Shanghai (UTC+8, no DST since 1991)."""
DATETIME_FORMAT = "%Y-%m-%d %H:%M:%S:%f"
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def datetime_ns(text: str) -> int:
    """Epoch ns of an older-parser CSV time ``%Y-%m-%d %H:%M:%S:%f`` written in Asia/Shanghai."""
    local = datetime.strptime(text.strip(), DATETIME_FORMAT).replace(tzinfo=SHANGHAI)
    return (local - _EPOCH) // timedelta(microseconds=1) * 1000


def _csv_rows(sink: Sink, reader: csv.DictReader) -> Iterator[tuple[int, dict[str, Any]]]:
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
        sink = Sink(run, path, fmt or "csv")
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


def _csv_row(sink: Sink, fmt: str, line: int, row: dict[str, Any], columns: tuple[str, str], generation: str,
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


def _import_requests(sink: Sink, reader: csv.DictReader) -> None:
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
