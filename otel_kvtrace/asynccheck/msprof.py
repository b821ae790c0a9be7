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

This module holds the shared sink, chrome_tracing.json and the symbols file; ``msprof_db`` the SQLite
files, ``msprof_csv`` the CSVs. Every span carries ``pid`` (an int wherever the format allows), ``source`` (the file kind, so the same span
read from several files of one capture is kept once: ``steps.dedup_sources``) and ``raw`` (its own name).
Malformed rows are skipped and reported with file and line (JSON: the line the event starts on;
SQLite: the row id; CSV: the line).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

from otel_kvtrace.asynccheck import model as m
from otel_kvtrace.asynccheck.classify import SYNC_HOOK_HANDLERS, canonical, markers_of
from otel_kvtrace.asynccheck.units import FORMAT_UNITS, parse_number, time_problem, to_ns

CAPTURE_LANE = "capture"
_TRAILING_PID = re.compile(r"-(\d+)$")
MSPTI_PID = re.compile(r"^ascend_service_profiler_(?:.*-)?(\d+)\.db$")


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


BATCH_TYPES = {0: "Prefill", 1: "Decode", 2: "Extend", 3: "Mixed", 5: "Dummy"}
"""MindIE ``batchType`` values as the parser maps them (``plugins/plugin_trace.py`` ``fix_batch_type``)."""


def batch_of(args: dict[str, Any]) -> dict[str, Any]:
    """``batch_size`` (MindIE attr / parser arg, else the ``rid`` list) and ``batch_type`` of a schedule span."""
    out: dict[str, Any] = {}
    size = args.get("batch_size")
    if isinstance(size, (int, float)) and not isinstance(size, bool) and 0 <= size < 10**7:
        out["batch_size"] = int(size)
    elif isinstance(args.get("rid"), list):
        out["batch_size"] = len(args["rid"])
    kind = args.get("batch_type")
    if isinstance(kind, str) and kind:
        out["batch_type"] = kind[:40]
    elif isinstance(args.get("batchType"), int) and not isinstance(args.get("batchType"), bool):
        out["batch_type"] = BATCH_TYPES.get(args["batchType"], "Other")
    return out


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


class Sink:
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
                attrs.update(batch_of(args))
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
    sink = Sink(run, path, "chrome")
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


def _chrome_event(sink: Sink, line: int, ev: Any) -> None:
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


# ---- vLLM symbols file ---------------------------------------------------------------------------------
def import_symbols_yaml(path: Path, run: str) -> m.ImportResult:
    """Warn when the msServiceProfiler vLLM symbol file enables the NPU-synchronising handlers."""
    sink = Sink(run, path)
    text = path.read_text(encoding="utf-8")
    active = [h for h in SYNC_HOOK_HANDLERS if re.search(rf"^(?!\s*#).*\b{h}\b", text, re.MULTILINE)]
    if active:
        sink.warn(
            m.WARN_NPU_SYNC_HOOKS,
            f"{path.name} enables msServiceProfiler hooks that synchronize the NPU ({', '.join(active)}); "
            "device/host overlap cannot be judged from this capture. Remove them and collect again.",
        )
    return sink.finish()
