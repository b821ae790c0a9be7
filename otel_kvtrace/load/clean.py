"""The loader's one definition of a valid line, span and attribute, and the line-by-line cleaner.

The fast path hands whole files to DuckDB and screens every row in SQL (``otlp_sql.SCREEN``); a file
the screen flags, or that DuckDB cannot parse, comes here. Every line is parsed as strict JSON, every
span and attribute is checked by the rules below, problems are recorded with file and line number, and
the valid remainder is written to a clean file that the same DuckDB SQL loads. The SQL screen flags
everything these rules reject (it may flag more: such a file only costs a trip through here), so both
paths load the same rows; ``tests/analysis/test_loader_fuzz.py`` checks that on generated inputs.

Rules: a span needs a 32-hex-digit ``traceId``, a 16-hex-digit ``spanId``, an empty or 16-hex-digit
``parentSpanId``, a non-empty scalar ``name``, and start/end times that are integers in ``[0, 2^63)``
(canonical decimal strings of ASCII digits, as OTLP/JSON writes them, or JSON integers). A bad span costs that
span. An attribute needs a scalar key, a value object with exactly one of the fields the loader reads
(or a kvlist/bytes value, kept and not read), an integer ``intValue`` in int64, and a key not seen
before in its list; a bad attribute costs that attribute, not its span or resource. Containers of the
wrong type (``resource``, ``scope``, ``status`` that are not objects) read as absent, as DuckDB reads
them.
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

INT64_MAX = 2**63 - 1
_DIGITS = re.compile(r"-?(0|[1-9][0-9]{0,18})")  # canonical: no sign but '-', no leading zeros
_HEX = {n: re.compile(f"[0-9a-fA-F]{{{n}}}") for n in (16, 32)}
_READ_VALUES = ("stringValue", "intValue", "boolValue", "doubleValue", "arrayValue")
_OPAQUE_VALUES = ("kvlistValue", "bytesValue")


@dataclass(slots=True)
class MalformedLine:
    """One input line (or one span or attribute of it) that was skipped, and why."""

    file: str
    line: int  # 1-based; 0 for the file as a whole
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
    """The raw lines of ``path``, transparently gunzipped (damaged gzip raises ``DamagedFile``)."""
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rb") as handle:
            yield from handle
    except (OSError, EOFError, zlib.error) as exc:  # BadGzipFile is an OSError
        raise DamagedFile(f"{type(exc).__name__}: {exc or 'truncated'}") from exc


class DamagedFile(Exception):
    """The file cannot be read past some point (damaged or truncated compression)."""


def parse_line(raw: bytes) -> Any:
    """Strict JSON (no NaN/Infinity, no trailing commas), integers exact at any size (orjson would turn
    integers beyond 64 bits into floats, changing the value). Raises ``ValueError``."""
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8: {exc}") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _is_int(value: Any, lo: int = -INT64_MAX - 1) -> bool:
    """An integer in ``[lo, 2^63)``, as a JSON integer or a decimal string of ASCII digits."""
    if isinstance(value, bool):
        return False
    if isinstance(value, str):
        if not _DIGITS.fullmatch(value) or value == "-0":
            return False
        value = int(value)
    return isinstance(value, int) and lo <= value <= INT64_MAX


def _is_hex(value: Any, length: int) -> bool:
    return isinstance(value, str) and _HEX[length].fullmatch(value) is not None


def _is_scalar_text(value: Any) -> bool:
    """A value DuckDB reads as text unchanged: a string, number or boolean (not null, object, list)."""
    return isinstance(value, (str, int, float)) and not (isinstance(value, str) and value[:1] in ("{", "["))


def attr_problem(attr: Any, seen: set[Any]) -> str | None:
    """Why one attribute cannot be kept, or None."""
    if not isinstance(attr, dict) or not _is_scalar_text(attr.get("key")):
        return "attribute without a key"
    key = attr["key"]
    value = attr.get("value")
    if not isinstance(value, dict):
        return f"attribute {key!r} has no value object"
    read = [name for name in _READ_VALUES if value.get(name) is not None]
    if len(read) > 1 or (not read and not any(value.get(name) is not None for name in _OPAQUE_VALUES)):
        return f"attribute {key!r} has no single typed value"
    if read == ["intValue"] and not _is_int(value["intValue"]):
        return f"attribute {key!r}: intValue is not an int64"
    if str(key) in seen:
        return f"duplicate attribute {key!r}"
    seen.add(str(key))
    return None


def clean_attributes(attrs: Any, where: str, problems: list[str]) -> Any:
    """``attrs`` without its bad attributes (each named in ``problems``); non-lists pass unchanged."""
    if not isinstance(attrs, list):
        return attrs
    seen: set[Any] = set()
    kept = []
    for attr in attrs:
        problem = attr_problem(attr, seen)
        if problem is None:
            kept.append(attr)
        else:
            problems.append(f"{where}{problem} (attribute dropped)")
    return kept


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
    if not _is_scalar_text(span.get("name")) or span["name"] == "":
        return "span has no name"
    for key in ("startTimeUnixNano", "endTimeUnixNano"):
        if not _is_int(span.get(key), lo=0):
            return f"{key} is not an integer in [0, 2^63)"
    return None


def clean_doc(doc: Any) -> tuple[dict | None, int, list[str]]:
    """The document with only valid spans and attributes, the count of valid spans, the problems found."""
    if not isinstance(doc, dict) or not isinstance(doc.get("resourceSpans"), list):
        return None, 0, ["not an OTLP trace request (no resourceSpans list)"]
    problems: list[str] = []
    kept_rs = []
    valid = 0
    for r_index, rs in enumerate(doc["resourceSpans"]):
        if not isinstance(rs, dict):
            problems.append(f"resourceSpans[{r_index}] is not an object")
            continue
        resource = rs.get("resource")
        if isinstance(resource, dict):
            resource = {**resource, "attributes": clean_attributes(
                resource.get("attributes"), f"resourceSpans[{r_index}] resource ", problems)}
        scope_spans = rs.get("scopeSpans")
        if scope_spans is not None and not isinstance(scope_spans, list):
            problems.append(f"resourceSpans[{r_index}].scopeSpans is not a list")
            scope_spans = None
        kept_ss = []
        for ss in scope_spans or []:
            spans = ss.get("spans") if isinstance(ss, dict) else None
            if not isinstance(spans, list):
                problems.append("scopeSpans entry without a spans list")
                continue
            good = []
            for index, span in enumerate(spans):
                problem = span_problem(span)
                if problem is not None:
                    problems.append(f"span {index}: {problem}")
                    continue
                good.append({**span, "attributes": clean_attributes(
                    span.get("attributes"), f"span {index} ", problems)})
            valid += len(good)
            kept_ss.append({"scope": ss.get("scope"), "spans": good})
        kept_rs.append({"resource": resource, "scopeSpans": kept_ss})
    return {"resourceSpans": kept_rs}, valid, problems


def foreign_format(doc: Any) -> str | None:
    """A sentence naming what ``doc`` is when it is a known trace format other than OTLP, else None."""
    traces = doc.get("data") if isinstance(doc, dict) and "data" in doc else doc if isinstance(doc, list) else [doc]
    if isinstance(traces, list) and traces and all(
            isinstance(t, dict) and "traceID" in t and "spans" in t for t in traces[:3]):
        return ("a Jaeger UI export (\"Download JSON\"), not OTLP/JSON; export OTLP instead: "
                "`kvtrace collect` or the Collector's file exporter write it (docs/collector.md)")
    if isinstance(doc, dict) and ("traceEvents" in doc or "displayTimeUnit" in doc) or (
            isinstance(doc, list) and doc[:1] and isinstance(doc[0], dict) and "ph" in doc[0]):
        return "a Chrome/Perfetto trace-event file, not OTLP/JSON; `kvtrace async check` reads profiler captures"
    return None


def _problems_of(doc: Any) -> tuple[dict | None, int, list[str]]:
    foreign = foreign_format(doc)
    return (None, 0, [foreign]) if foreign else clean_doc(doc)


def _dump(doc: dict) -> bytes:
    try:
        return orjson.dumps(doc) + b"\n"
    except TypeError:  # an integer beyond 64 bits in a field the loader does not read
        return json.dumps(doc, separators=(",", ":")).encode() + b"\n"


def clean_file(path: Path, out_dir: Path) -> CleanResult:
    """Write the valid content of ``path`` to a clean ``.jsonl`` in ``out_dir``; report what was skipped.

    A file that is one pretty-printed JSON document (the OTLP spec's own examples) is read as one line
    1; damaged gzip costs what follows the damage, named with the line where the damage starts.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    clean_path = out_dir / f"{len(list(out_dir.iterdir()))}-{path.name.removesuffix('.gz')}.clean.jsonl"
    malformed: list[MalformedLine] = []
    lines = valid_spans = parsed = 0
    number = 0
    with open(clean_path, "wb") as out:
        def take(line_number: int, doc: Any) -> None:
            nonlocal valid_spans
            cleaned, valid, problems = _problems_of(doc)
            malformed.extend(MalformedLine(str(path), line_number, problem) for problem in problems)
            if cleaned is not None and valid:
                out.write(_dump(cleaned))
                valid_spans += valid

        try:
            for number, raw in enumerate(open_lines(path), start=1):
                lines += 1
                if not raw.strip():
                    continue
                try:
                    doc = parse_line(raw)
                except ValueError as exc:
                    malformed.append(MalformedLine(str(path), number, f"not JSON ({exc})"))
                    continue
                parsed += 1
                take(number, doc)
        except DamagedFile as exc:
            malformed.append(MalformedLine(str(path), number + 1, f"damaged compressed data; the rest of the file "
                                           f"is lost ({exc})"))
            return CleanResult(clean_path, lines, valid_spans, malformed)
        if malformed and not parsed:  # no line parsed: maybe one pretty-printed document
            try:
                whole = parse_line(b"".join(open_lines(path)))
            except (ValueError, DamagedFile):
                return CleanResult(clean_path, lines, valid_spans, malformed)
            malformed = []
            take(1, whole)
    return CleanResult(clean_path, lines, valid_spans, malformed)
