"""Pick the importer for each capture file; read our own OTLP JSON lines async traces.

``import_paths`` walks files and directories and dispatches by name and content: ``*.jsonl`` (our
traces, docs/schema.md "Files" shape), ``*.json`` (chrome tracing array, or one OTLP request),
``*.csv`` (``forward.csv``/``batch.csv``), ``*.db`` (``slice`` / MSPTI tables), ``*.yaml`` (vLLM
symbols file). Unsupported files are reported as warnings, never silently dropped.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import orjson

from otel_kvtrace.asynccheck import model as m
from otel_kvtrace.asynccheck import msprof

_CANONICAL = frozenset(m.STEP_CHILD_SPANS)


def _attr_value(value: dict[str, Any]) -> Any:
    if "intValue" in value:
        return int(value["intValue"])
    for key in ("stringValue", "boolValue", "doubleValue"):
        if key in value:
            return value[key]
    return None


def _attrs(items: Iterable[dict[str, Any]] | None) -> dict[str, Any]:
    return {kv["key"]: _attr_value(kv.get("value", {})) for kv in items or ()}


def import_otlp_json(path: Path, run: str) -> m.ImportResult:
    """Spans of our async traces (one ``ExportTraceServiceRequest`` per line)."""
    result = m.ImportResult()
    batch_queue_steps = 0
    dropped = 0
    with path.open("rb") as fh:
        for line_no, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                doc = orjson.loads(line)
                resource_spans = doc["resourceSpans"]
            except (orjson.JSONDecodeError, KeyError, TypeError):
                result.issues.append(m.ImportIssue(run, str(path), line_no, "not an OTLP/JSON trace request line"))
                continue
            for rs in resource_spans:
                res = _attrs(rs.get("resource", {}).get("attributes"))
                lane = f"{res.get('kvtrace.run_id', path.stem)}/pid{res.get('process.pid', 0)}"
                for ss in rs.get("scopeSpans") or ():
                    for span in ss.get("spans") or ():
                        try:
                            name = span["name"]
                            start, end = int(span["startTimeUnixNano"]), int(span["endTimeUnixNano"])
                        except (KeyError, TypeError, ValueError):
                            result.issues.append(
                                m.ImportIssue(run, str(path), line_no, "span without name or start/end times")
                            )
                            continue
                        attrs = _attrs(span.get("attributes"))
                        if name == m.STEP_SPAN:
                            batch_queue_steps += bool(attrs.get(m.ATTR_BATCH_QUEUE))
                            dropped = max(dropped, int(attrs.get("kvtrace.exporter.dropped") or 0))
                        if name not in _CANONICAL:
                            continue
                        step = attrs.get(m.ATTR_STEP)
                        result.spans.append(m.SpanRow(run, str(path), lane, step, name, name, start, end, attrs))
                        result.seen.add(name)
    if batch_queue_steps:
        result.markers.append(m.Marker(run, str(path), m.MARKER_BATCH_QUEUE, batch_queue_steps))
    if dropped:
        result.warnings.append(
            m.CaptureWarning(run, str(path), m.WARN_DROPPED, f"the recorder dropped {dropped} stamps; steps are missing")
        )
    return result


def _import_json(path: Path, run: str) -> m.ImportResult:
    with path.open("rb") as fh:
        head = fh.read(4096).lstrip()
    if head.startswith(b"{") and b"resourceSpans" in head:
        return import_otlp_json(path, run)
    return msprof.import_chrome_tracing(path, run)


_BY_SUFFIX: dict[str, Callable[[Path, str], m.ImportResult]] = {
    ".jsonl": import_otlp_json,
    ".json": _import_json,
    ".csv": msprof.import_csv,
    ".db": msprof.import_sqlite,
    ".yaml": msprof.import_symbols_yaml,
    ".yml": msprof.import_symbols_yaml,
}


def capture_files(paths: Iterable[str | Path]) -> list[Path]:
    """Every importable file under ``paths``; raises FileNotFoundError naming a missing path."""
    out: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if not p.exists():
            raise FileNotFoundError(f"no such file or directory: {p}")
        if p.is_dir():
            out += sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in _BY_SUFFIX)
        else:
            out.append(p)
    return out


def import_paths(paths: Iterable[str | Path], run: str) -> m.ImportResult:
    """Import every capture file under ``paths`` as one run."""
    result = m.ImportResult()
    for path in capture_files(paths):
        importer = _BY_SUFFIX.get(path.suffix)
        if importer is None:
            result.warnings.append(
                m.CaptureWarning(run, str(path), "unsupported_file", f"{path.name}: unknown format; not imported")
            )
            continue
        try:
            result.extend(importer(path, run))
        except (OSError, ValueError, UnicodeDecodeError, sqlite3.Error) as exc:
            result.issues.append(m.ImportIssue(run, str(path), 0, f"cannot read: {exc}"))
    return result
