"""Line-by-line cleaning of an OTLP/JSON lines file that DuckDB refused as a whole.

The fast path hands whole files to DuckDB. When a file has a bad line (a truncated write after a crash,
a stray log line, a span without ids), DuckDB fails the file, and this module re-reads it in Python:
every line is parsed with orjson, every span is checked for the fields the loader needs, bad lines and
bad spans are recorded with file and line number, and the valid remainder is written to a clean file
for DuckDB. Nothing valid is dropped: a line with one broken span keeps its other spans.
"""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson


@dataclass(slots=True)
class MalformedLine:
    """One input line (or one span of it) that was skipped, and why."""

    file: str
    line: int  # 1-based
    reason: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.reason}"


@dataclass(slots=True)
class CleanResult:
    clean_path: Path
    lines: int
    valid_spans: int
    malformed: list[MalformedLine]


def open_lines(path: Path) -> Iterator[bytes]:
    """The raw lines of ``path``, transparently gunzipped."""
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rb") as handle:
        yield from handle


def _is_int_text(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    return isinstance(value, str) and value.lstrip("-").isdigit() and len(value) <= 19


def _is_hex(value: Any, length: int) -> bool:
    if not isinstance(value, str) or len(value) != length:
        return False
    try:
        int(value, 16)
    except ValueError:
        return False
    return True


def _attr_problem(attrs: Any) -> str | None:
    if attrs is None:
        return None
    if not isinstance(attrs, list):
        return "attributes is not a list"
    seen: set[str] = set()
    for attr in attrs:
        if not isinstance(attr, dict) or not isinstance(attr.get("key"), str):
            return "attribute without a string key"
        value = attr.get("value")
        if not isinstance(value, dict) or len(value) != 1:
            return f"attribute {attr.get('key')!r} has no single typed value"
        if attr["key"] in seen:
            return f"duplicate attribute {attr['key']!r}"
        seen.add(attr["key"])
        inner = next(iter(value.values()))
        if "intValue" in value and not _is_int_text(inner):
            return f"attribute {attr['key']!r}: intValue is not an integer"
    return None


def span_problem(span: Any) -> str | None:
    """Why ``span`` cannot be loaded, or None when it can."""
    if not isinstance(span, dict):
        return "span is not an object"
    if not _is_hex(span.get("traceId"), 32):
        return "traceId is not 32 hex digits"
    if not _is_hex(span.get("spanId"), 16):
        return "spanId is not 16 hex digits"
    parent = span.get("parentSpanId")
    if parent not in (None, "") and not _is_hex(parent, 16):
        return "parentSpanId is not 16 hex digits"
    if not isinstance(span.get("name"), str) or not span["name"]:
        return "span has no name"
    for key in ("startTimeUnixNano", "endTimeUnixNano"):
        if not _is_int_text(span.get(key)):
            return f"{key} is not an integer"
    status = span.get("status")
    if status is not None and not isinstance(status, dict):
        return "status is not an object"
    return _attr_problem(span.get("attributes"))


def _clean_doc(doc: Any) -> tuple[dict | None, int, list[str]]:
    """The document with only valid spans, the count of valid spans and the problems found."""
    if not isinstance(doc, dict) or not isinstance(doc.get("resourceSpans"), list):
        return None, 0, ["not an OTLP trace request (no resourceSpans list)"]
    problems: list[str] = []
    kept_rs = []
    valid = 0
    for rs in doc["resourceSpans"]:
        if not isinstance(rs, dict):
            problems.append("resourceSpans entry is not an object")
            continue
        resource = rs.get("resource") or {}
        if not isinstance(resource, dict) or _attr_problem(resource.get("attributes")):
            problems.append("bad resource attributes")
            continue
        kept_ss = []
        for ss in rs.get("scopeSpans") or []:
            spans = ss.get("spans") if isinstance(ss, dict) else None
            if not isinstance(spans, list):
                problems.append("scopeSpans entry without a spans list")
                continue
            good = []
            for index, span in enumerate(spans):
                problem = span_problem(span)
                if problem is None:
                    good.append(span)
                else:
                    problems.append(f"span {index}: {problem}")
            valid += len(good)
            kept_ss.append({"scope": ss.get("scope") or {}, "spans": good})
        kept_rs.append({"resource": resource, "scopeSpans": kept_ss})
    return {"resourceSpans": kept_rs}, valid, problems


def clean_file(path: Path, out_dir: Path) -> CleanResult:
    """Write the valid content of ``path`` to a clean ``.jsonl`` in ``out_dir``; report what was skipped."""
    out_dir.mkdir(parents=True, exist_ok=True)
    clean_path = out_dir / (path.name.removesuffix(".gz") + ".clean.jsonl")
    malformed: list[MalformedLine] = []
    lines = valid_spans = 0
    with open(clean_path, "wb") as out:
        for number, raw in enumerate(open_lines(path), start=1):
            lines += 1
            if not raw.strip():
                continue
            try:
                doc = orjson.loads(raw)
            except orjson.JSONDecodeError as exc:
                malformed.append(MalformedLine(str(path), number, f"not JSON ({exc})"))
                continue
            cleaned, valid, problems = _clean_doc(doc)
            for problem in problems:
                malformed.append(MalformedLine(str(path), number, problem))
            if cleaned is not None and valid:
                out.write(orjson.dumps(cleaned) + b"\n")
                valid_spans += valid
    return CleanResult(clean_path, lines, valid_spans, malformed)
