"""Pick the importer for each capture file; read our own OTLP JSON lines async traces.

``import_paths`` walks files and directories and dispatches by name and content: ``*.jsonl`` (our
traces, docs/schema.md "Files" shape), ``*.json`` (chrome tracing array, or one OTLP request),
``*.csv`` (``forward.csv``/``batch.csv``/``request.csv``), ``*.db`` (``slice``/``Mstx``/MSPTI tables),
``*.yaml`` (vLLM symbols file). Unsupported files are reported as warnings, never silently dropped; a file
that cannot be parsed at all is one ``file:0`` import error, never a traceback.
"""

from __future__ import annotations

import csv
import sqlite3
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import orjson

from otel_kvtrace.asynccheck import model as m
from otel_kvtrace.asynccheck import msprof, msprof_csv, msprof_db
from otel_kvtrace.load.clean import DamagedFile, clean_doc, open_lines, parse_line

_CANONICAL = frozenset(m.STEP_CHILD_SPANS)


def _attr_value(value: Any) -> Any:
    if not isinstance(value, dict):
        return None
    if "intValue" in value:
        return int(value["intValue"])
    for key in ("stringValue", "boolValue", "doubleValue"):
        if key in value:
            return value[key]
    return None


def _attrs(items: Iterable[dict[str, Any]] | None) -> dict[str, Any]:
    return {kv["key"]: _attr_value(kv.get("value")) for kv in items or () if isinstance(kv, dict) and "key" in kv}


def import_otlp_json(path: Path, run: str) -> m.ImportResult:
    """Spans of our async traces (one ``ExportTraceServiceRequest`` per line).

    Lines, spans and attributes are checked by the project loader's one validation
    (``load.clean.parse_line`` + ``clean_doc``), so a span this reader keeps is one ``kvtrace report``
    would load and a bad attribute costs that attribute only; other kvtrace spans (KV recv traces) are
    counted in ``seen`` as ``otlp_other:<n>`` so that ``check`` can say which command reads them.
    """
    result = m.ImportResult()
    batch_queue_steps = dropped = outputs_lost = other = 0
    try:
        for line_no, line in enumerate(open_lines(path), 1):
            if not line.strip():
                continue
            try:
                doc, _valid, problems = clean_doc(parse_line(line))
            except ValueError as exc:
                doc, problems = None, [f"not JSON: {exc}"]
            for problem in problems:
                result.issues.append(m.ImportIssue(run, str(path), line_no, f"skipped: {problem}"))
            for rs in (doc or {}).get("resourceSpans", ()):
                resource = rs.get("resource")
                res = _attrs(resource.get("attributes") if isinstance(resource, dict) else None)
                lane = f"{res.get('kvtrace.run_id', path.stem)}/pid{res.get('process.pid', 0)}"
                for ss in rs["scopeSpans"]:
                    for span in ss["spans"]:
                        start, end = int(span["startTimeUnixNano"]), int(span["endTimeUnixNano"])
                        if end < start:
                            result.issues.append(
                                m.ImportIssue(run, str(path), line_no, "span skipped: ends before it starts"))
                            continue
                        name = span["name"]
                        attrs = _attrs(span.get("attributes"))
                        if name == m.STEP_SPAN:
                            batch_queue_steps += bool(attrs.get(m.ATTR_BATCH_QUEUE))
                            dropped = max(dropped, _int(attrs.get("kvtrace.exporter.dropped")))
                        if name in (m.STEP_SPAN, m.OUTPUT_READY):
                            outputs_lost = max(outputs_lost, _int(attrs.get(m.ATTR_OUTPUTS_DROPPED)))
                        if name not in _CANONICAL:
                            other += not name.startswith("kvtrace.async")
                            continue
                        step = attrs.get(m.ATTR_STEP)
                        step = step if isinstance(step, int) else None
                        if step is not None and "vllm.dp_rank" in res:
                            attrs["dp_rank"] = res["vllm.dp_rank"]  # the engine's DP rank (runs.split_processes)
                        if name in m.WORKER_SPANS and "process.parent_pid" in res:
                            attrs["ppid"] = res["process.parent_pid"]  # its engine process (runs.split_processes)
                        result.spans.append(m.SpanRow(run, str(path), lane, step, name, name, start, end, attrs))
                        result.seen.add(name)
    except DamagedFile as exc:
        result.issues.append(m.ImportIssue(run, str(path), 0, f"damaged file: {exc}"))
    if other:
        result.seen.add(f"otlp_other:{other}")
    if batch_queue_steps:
        result.markers.append(m.Marker(run, str(path), m.MARKER_BATCH_QUEUE, batch_queue_steps))
    if dropped:
        result.warnings.append(
            m.CaptureWarning(run, str(path), m.WARN_DROPPED, f"the recorder dropped {dropped} stamps; steps are missing")
        )
    if outputs_lost:
        result.warnings.append(m.CaptureWarning(
            run, str(path), m.WARN_OUTPUTS_DROPPED, f"the output-ready watcher dropped {outputs_lost} outputs (too "
            "many in flight): those steps fall back to the time the engine observed their output"))
    return result


def _int(value: Any) -> int:
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0


def _import_json(path: Path, run: str) -> m.ImportResult:
    with path.open("rb") as fh:
        head = fh.read(4096).lstrip()
    if head.startswith(b"{") and b"resourceSpans" in head:
        return import_otlp_json(path, run)
    return msprof.import_chrome_tracing(path, run)


_UNREADABLE = (OSError, ValueError, UnicodeDecodeError, sqlite3.Error, csv.Error, RecursionError, OverflowError,
               TypeError, AttributeError, KeyError, IndexError, MemoryError)
"""A file that fails with one of these is reported as unreadable (``file:0``); the others are still read."""

_BY_SUFFIX: dict[str, Callable[[Path, str], m.ImportResult]] = {
    ".jsonl": import_otlp_json,
    ".json": _import_json,
    ".csv": msprof_csv.import_csv,
    ".db": msprof_db.import_sqlite,
    ".yaml": msprof.import_symbols_yaml,
    ".yml": msprof.import_symbols_yaml,
}


def _importer_for(path: Path) -> Callable[[Path, str], m.ImportResult] | None:
    if path.name.endswith(".jsonl.gz"):
        return import_otlp_json
    return _BY_SUFFIX.get(path.suffix)


def capture_files(paths: Iterable[str | Path]) -> list[Path]:
    """Every importable file under ``paths``; raises FileNotFoundError naming a missing path."""
    return list(_files_with_roots(paths))


def _files_with_roots(paths: Iterable[str | Path]) -> dict[Path, str]:
    """``file -> capture root``: the directory given for files found under it, else the file's folder.

    A root inside another given root joins it. One capture (a parse output with its raw DBs below it, or
    its files named one by one) has one root; two capture folders have two, so they are never merged
    into one verdict (``runs.split_runs``).
    """
    out: dict[Path, str] = {}
    for raw in paths:
        p = Path(raw)
        if not p.exists():
            raise FileNotFoundError(f"no such file or directory: {p}")
        if p.is_dir():
            for f in sorted(f for f in p.rglob("*") if f.is_file() and _importer_for(f) is not None):
                out.setdefault(f, str(p))
        else:
            out.setdefault(p, str(p.parent))
    roots = {r: Path(r).resolve() for r in set(out.values())}
    outer = {r: min((o for o, op in roots.items() if rp == op or op in rp.parents), key=len) for r, rp in roots.items()}
    return {f: outer[r] for f, r in out.items()}


def import_paths(paths: Iterable[str | Path], run: str) -> m.ImportResult:
    """Import every capture file under ``paths`` as one run."""
    result = m.ImportResult()
    for path, root in _files_with_roots(paths).items():
        importer = _importer_for(path)
        if importer is None:
            result.warnings.append(
                m.CaptureWarning(run, str(path), "unsupported_file", f"{path.name}: unknown format; not imported")
            )
            continue
        try:
            one = importer(path, run)
            for span in one.spans:
                if span.step is None:
                    span.attrs["capture"] = root
            result.extend(one)
        except _UNREADABLE as exc:
            result.issues.append(m.ImportIssue(run, str(path), 0, f"cannot read: {type(exc).__name__}: {str(exc)[:200]}"))
    return result
