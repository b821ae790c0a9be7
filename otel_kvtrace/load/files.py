"""Turn the paths a user typed (files, directories, globs) into the list of trace files to read."""

from __future__ import annotations

import glob
from collections.abc import Iterable
from pathlib import Path

TRACE_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".ndjson", ".ndjson.gz")
"""File names a directory is searched for (recursively)."""


def _is_trace_file(path: Path) -> bool:
    """A file a directory contributes: a trace suffix, and not a resource series file (``resources-*``,
    ``otlp-metrics-*``: ``otel_kvtrace.resources`` reads those beside the traces)."""
    from otel_kvtrace.resources.table import OTLP_PREFIX, RECORD_PREFIX

    name = path.name
    return path.is_file() and name.endswith(TRACE_SUFFIXES) and not name.startswith((OTLP_PREFIX, RECORD_PREFIX))


class LoadError(ValueError):
    """Input that cannot be loaded: no such file, no usable spans, undecodable file."""


def resolve_inputs(paths: Iterable[str | Path]) -> list[Path]:
    """Expand ``paths`` into a sorted, de-duplicated list of existing trace files.

    A directory contributes every ``*.jsonl``/``*.json``/``*.ndjson`` file below it (``.gz`` too) except
    resource series files (``resources-*``, ``otlp-metrics-*``); a
    pattern with ``*``/``?``/``[`` is a glob (``**`` recurses). Raises ``LoadError`` naming the path when
    something matches nothing, so a typo is never silently an empty report.
    """
    found: dict[Path, None] = {}
    for raw in paths:
        text = str(raw)
        if any(ch in text for ch in "*?["):
            matches = [Path(m) for m in sorted(glob.glob(text, recursive=True)) if Path(m).is_file()]
            if not matches:
                raise LoadError(f"glob {text!r} matches no files")
            for match in matches:
                found[match.resolve()] = None
            continue
        path = Path(text)
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if _is_trace_file(p))
            if not files:
                raise LoadError(
                    f"directory {text!r} holds no trace files ({', '.join(TRACE_SUFFIXES)}); `kvtrace collect --out "
                    f"{text}` or the Collector's file exporter writes them, `kvtrace report {text}` reads them")
            for file in files:
                found[file.resolve()] = None
        elif path.is_file():
            found[path.resolve()] = None
        else:
            raise LoadError(f"no such file or directory: {text!r}")
    if not found:
        raise LoadError("no input paths given")
    return sorted(found)
